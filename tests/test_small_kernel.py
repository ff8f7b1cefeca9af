"""The small-problem DSelect-k kernel (``_DSelectSmall``) computes the fused kernel's numbers.

Values and gradients against ``_DSelectFused`` and the composed formulas, float64 gradcheck,
binary bits (exact zeros among the factors), one γ per gate, and the dispatch of
:func:`dselectk.functional.dselect_k_fused` by problem size. No timings here.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from dselectk import functional as DF
from dselectk.kernels import dispatch
from dselectk.kernels.aten import _DSelectFused, _DSelectSmall
from dselectk.runtime import intra_op_threads

F64 = torch.float64


def _inputs(g: int, k: int, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    alpha = torch.randn(g, k, dtype=F64, requires_grad=True)
    z = torch.randn(g, k, m, dtype=F64) * 0.6
    z[0, 0, 0] = 5.0  # a binary bit: exact 0/1 factors
    z[-1, -1, -1] = -5.0
    return alpha, z.requires_grad_()


@pytest.mark.parametrize(("g", "k", "m"), [(1, 1, 1), (3, 2, 1), (5, 3, 2), (4, 4, 7), (2, 2, 4)])
@pytest.mark.parametrize("per_gate", [False, True])
def test_small_kernel_matches_fused_kernel(g: int, k: int, m: int, per_gate: bool) -> None:
    alpha, z = _inputs(g, k, m)
    gamma = torch.rand(g, dtype=F64) + 0.5 if per_gate else torch.tensor(0.7, dtype=F64)
    ws, es = _DSelectSmall.apply(z, alpha, gamma)[:2]
    wf, ef = _DSelectFused.apply(z, alpha, gamma)[:2]
    torch.testing.assert_close(ws, wf, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(es, ef, rtol=1e-12, atol=1e-14)
    g_w, g_e = torch.randn_like(ws), torch.randn_like(es)
    for outs in [(0, 1), (0,), (1,)]:
        small = [(ws, g_w), (es, g_e)]
        fused = [(wf, g_w), (ef, g_e)]
        gs = torch.autograd.grad(
            [small[i][0] for i in outs], (alpha, z), [small[i][1] for i in outs],
            retain_graph=True, allow_unused=True,
        )  # fmt: skip
        gf = torch.autograd.grad(
            [fused[i][0] for i in outs], (alpha, z), [fused[i][1] for i in outs],
            retain_graph=True, allow_unused=True,
        )  # fmt: skip
        for a, b in zip(gs, gf):
            if a is None or b is None:  # entropies only: α gets no gradient (or a zero one)
                assert (a is None or not a.any()) and (b is None or not b.any())
                continue
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("m", [1, 3, 4])
def test_small_kernel_gradcheck(m: int) -> None:
    alpha, z = _inputs(3, 2, m, seed=1)
    gamma = torch.tensor(1.3, dtype=F64)
    assert gradcheck(lambda a, zz: _DSelectSmall.apply(zz, a, gamma)[:2], (alpha, z))
    assert gradcheck(lambda a, zz: _DSelectSmall.apply(zz, a, gamma)[0], (alpha, z))
    assert gradcheck(lambda a, zz: _DSelectSmall.apply(zz, a, gamma)[1], (alpha, z))


def test_dispatch_by_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small problems take the small kernel, large ones the fused kernel; same numbers."""
    calls: list[str] = []
    for cls in (_DSelectSmall, _DSelectFused):
        orig = cls.apply

        def spy(*args: object, _orig: object = orig, _name: str = cls.__name__) -> object:
            calls.append(_name)
            return _orig(*args)  # type: ignore[operator]

        monkeypatch.setattr(cls, "apply", spy)
    k, m = 4, 7
    for b in (
        1,
        dispatch.SMALL_MAX_ELEMENTS // (k * 2**m),
        dispatch.SMALL_MAX_ELEMENTS // (k * 2**m) + 1,
    ):
        alpha, z = _inputs(b, k, m)
        w, ent = dispatch.dselect_k_fused(alpha, z, 0.9)
        p = DF.smooth_step(z, 0.9)
        ref = (torch.softmax(alpha, -1).unsqueeze(-1) * DF.selector(p)).sum(-2)
        torch.testing.assert_close(w, ref)
        torch.testing.assert_close(ent, DF.selector_entropy(p))
    assert calls == ["_DSelectSmall", "_DSelectSmall", "_DSelectFused"]


def test_small_kernel_under_vmap() -> None:
    alpha, z = _inputs(4, 2, 3)
    gamma = torch.tensor(1.0, dtype=F64)
    got = torch.vmap(lambda a, zz: _DSelectSmall.apply(zz, a, gamma)[0])(
        alpha.unsqueeze(1), z.unsqueeze(1)
    )
    torch.testing.assert_close(got.squeeze(1), _DSelectSmall.apply(z, alpha, gamma)[0])


def test_intra_op_threads_restores() -> None:
    before = torch.get_num_threads()
    with intra_op_threads(1) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with intra_op_threads(1, elements=2**40) as n:  # large problems keep their threads
        assert n == before == torch.get_num_threads()
    with pytest.raises(RuntimeError), intra_op_threads(1):
        raise RuntimeError
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("broadcast_max", [0, 2**40])
@pytest.mark.parametrize("m", [1, 2, 5, 6])
def test_fused_kernel_combine_both_ways(
    monkeypatch: pytest.MonkeyPatch, broadcast_max: int, m: int
) -> None:
    """The fused kernel's combine as multiply-add loops (large problems) and as one broadcast
    product (small ones): the composed formulas' values and gradients either way."""
    from dselectk.kernels import aten

    monkeypatch.setattr(aten, "_BROADCAST_MAX_ELEMENTS", broadcast_max)
    alpha, z = _inputs(6, 3, m, seed=2)
    gamma = torch.tensor(0.8, dtype=F64)
    w, ent = _DSelectFused.apply(z, alpha, gamma)[:2]
    p = DF.smooth_step(z, 0.8)
    ref_w = (torch.softmax(alpha, -1).unsqueeze(-1) * DF.selector(p)).sum(-2)
    ref_e = DF.selector_entropy(p)
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(ent, ref_e)
    g_w, g_e = torch.randn_like(w), torch.randn_like(ent)
    got = torch.autograd.grad([w, ent], (alpha, z), [g_w, g_e])
    ref = torch.autograd.grad([ref_w, ref_e], (alpha, z), [g_w, g_e])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    assert gradcheck(lambda a, zz: _DSelectFused.apply(zz, a, gamma)[:2], (alpha, z))
