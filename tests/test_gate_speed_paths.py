"""The host (NumPy) small kernel and the one-node gate path of issue 25 compute the ATen
kernels' numbers.

``_DSelectSmall`` on CPU float32/float64 computes in NumPy; ``DSelectK`` takes small CPU
problems to ``_DSelectSmallGate`` (logits in, weights and auxiliary loss out). Checked here:
values and gradients against the ATen small kernel and the composed formulas (float64, odd and
even M: with and without the ones row of the table), binary bits, one γ per gate, float64
gradcheck of both nodes, which path the gate takes, and only-the-weights / only-the-loss
backward passes. No timings here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.autograd import gradcheck

from dselectk import functional as DF
from dselectk.gates import DSelectK, DSelectKExtended
from dselectk.kernels import aten as _kernels
from dselectk.kernels import dispatch, host_numpy
from dselectk.kernels.aten import _DSelectSmall, _DSelectSmallGate, _DSelectSmallGateLinear

F64 = torch.float64


#: these tests are about the NumPy host kernel and its size limits (conftest's numpy_kernel)
pytestmark = pytest.mark.usefixtures("numpy_kernel")


def _aten_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn the host kernels off: the ATen small kernel and the gate's composed path."""
    monkeypatch.setattr(_kernels, "_host_ok", lambda *t: False)
    monkeypatch.setattr(dispatch, "_host_ok", lambda *t: False)


def _inputs(g: int, k: int, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    alpha = torch.randn(g, k, dtype=F64, requires_grad=True)
    z = torch.randn(g, k, m, dtype=F64) * 0.6
    z[0, 0, 0] = 5.0  # binary bits: exact 0/1 factors
    z[-1, -1, -1] = -5.0
    return alpha, z.requires_grad_()


def _run(alpha: torch.Tensor, z: torch.Tensor, gamma: torch.Tensor, outs: tuple[int, ...]) -> Any:
    w, ent = _DSelectSmall.apply(z, alpha, gamma)[:2]
    torch.manual_seed(1)
    g = [torch.randn_like(w), torch.randn_like(ent)]
    got = torch.autograd.grad(
        [(w, ent)[i] for i in outs], (alpha, z), [g[i] for i in outs], allow_unused=True
    )
    return w.detach(), ent.detach(), got


@pytest.mark.parametrize(("g", "k", "m"), [(1, 1, 1), (3, 2, 2), (5, 3, 3), (2, 4, 6), (4, 4, 7)])
@pytest.mark.parametrize("per_gate", [False, True])
@pytest.mark.parametrize("outs", [(0, 1), (0,), (1,)])
@pytest.mark.parametrize("table_matmul", [True, False])
def test_host_small_kernel_matches_aten_kernel(
    monkeypatch: pytest.MonkeyPatch,
    g: int,
    k: int,
    m: int,
    per_gate: bool,
    outs: tuple[int, ...],
    table_matmul: bool,
) -> None:
    """Both ways of summing the factors' grads onto the table (a 0/1 product, per-bit sums)."""
    if not table_matmul:
        monkeypatch.setattr(host_numpy, "_HOST_MATMUL_MAX_MACS", 0)
    alpha, z = _inputs(g, k, m)
    gamma = torch.rand(g, dtype=F64) + 0.5 if per_gate else torch.tensor(0.7, dtype=F64)
    assert _kernels._host_ok(z, alpha)
    w, ent, grads = _run(alpha, z, gamma, outs)
    with monkeypatch.context() as mp:
        _aten_only(mp)
        w_ref, ent_ref, grads_ref = _run(alpha, z, gamma, outs)
    torch.testing.assert_close(w, w_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-12, atol=1e-14)
    for a, b in zip(grads, grads_ref, strict=True):
        if a is None or b is None:  # entropies only: α gets no gradient
            assert (a is None or not a.any()) and (b is None or not b.any())
            continue
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)
    # against the composed formulas too
    p = DF.smooth_step(z, gamma[:, None, None] if per_gate else gamma).detach()
    ref = (torch.softmax(alpha.detach(), -1).unsqueeze(-1) * DF.selector(p)).sum(-2)
    torch.testing.assert_close(w, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ent, DF.selector_entropy(p), rtol=1e-12, atol=1e-14)


def test_host_small_kernel_binary_bits_are_exact() -> None:
    """Binary S(Z): exact zeros off the selected codes, exact one-hot selectors."""
    alpha = torch.randn(3, 2, dtype=F64)
    z = torch.tensor([[[5.0, -5.0, 5.0], [-5.0, -5.0, 5.0]]] * 3, dtype=F64)
    w, ent = _DSelectSmall.apply(z, alpha, torch.tensor(1.0, dtype=F64))[:2]
    a = torch.softmax(alpha, -1)
    want = torch.zeros(3, 8, dtype=F64)
    want[:, 0b101] = a[:, 0]
    want[:, 0b100] = a[:, 1]
    torch.testing.assert_close(w, want, rtol=1e-15, atol=0)
    assert (w[:, [1, 2, 3, 6, 7]] == 0).all() and (ent == 0).all()


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_host_small_kernel_gradcheck(m: int) -> None:
    alpha, z = _inputs(3, 2, m, seed=1)
    gamma = torch.tensor(1.3, dtype=F64)
    assert gradcheck(lambda a, zz: _DSelectSmall.apply(zz, a, gamma)[:2], (alpha, z))
    per_gate = torch.tensor([1.3, 0.4, 2.0], dtype=F64)
    assert gradcheck(lambda a, zz: _DSelectSmall.apply(zz, a, per_gate)[:2], (alpha, z))


def _gate_outputs(gate: DSelectK, x: torch.Tensor | None, seed: int = 3) -> list[torch.Tensor]:
    """Weights, aux loss, and the grads of the parameters of a fixed random loss."""
    out = gate(x)
    g = torch.randn(out.weights.shape, generator=torch.Generator().manual_seed(seed))
    loss = (out.weights * g.to(out.weights)).sum() + out.aux_loss
    grads = torch.autograd.grad(loss, list(gate.parameters()))
    return [out.weights.detach(), out.aux_loss.detach(), *grads]


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of the one-node gates (with or without the linear layer inside)."""
    calls: list[int] = []
    for cls in (_DSelectSmallGate, _DSelectSmallGateLinear):

        def spy(*args: Any, _orig: Any = cls.apply) -> Any:
            calls.append(1)
            return _orig(*args)

        monkeypatch.setattr(cls, "apply", spy)
    return calls


CASES = [
    # (n, k, in_features, num_gates, entropy_reg, gamma, diversity, xi)
    (8, 3, 5, None, 0.3, 1.0, 0.0, 1.0),
    (128, 4, 6, None, 0.1, 0.7, 0.0, 1.0),
    (16, 2, 5, 3, [0.0, 0.2, 1.0], [0.5, 1.0, 3.0], 0.0, 1.0),
    (8, 2, None, None, 0.5, 1.5, 0.0, 1.0),
    (32, 3, None, 4, 0.05, [0.3, 1.0, 2.0, 0.8], [0.0, 0.1, 0.5, 1.0], 1.0),
    (5, 2, 4, None, 0.2, 1.0, 0.0, 0.0),  # n < 2**M without the unused-code penalty
    (2, 1, 3, None, 0.2, 1.0, 0.0, 1.0),  # M = 1
    (128, 4, 6, None, 0.1, 0.7, 0.0, 1.0, 20),  # above SMALL_MAX_ELEMENTS (else: fused kernel)
    (64, 2, 5, 3, [0.0, 0.2, 1.0], [0.5, 1.0, 3.0], 0.0, 1.0, 30),
]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("case", CASES)
def test_gate_host_path_matches_composed_path(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, case: tuple[Any, ...]
) -> None:
    n, k, p, t, lam, gamma, mu, xi, *batch = case
    torch.manual_seed(0)
    cls = DSelectK if mu == 0.0 else DSelectKExtended  # (the diversity μ is the latter's)
    gate = cls(n, k, in_features=p, num_gates=t, xi=xi).to(dtype)
    gate.entropy_reg, gate.gamma = lam, gamma
    if cls is DSelectKExtended:
        gate.diversity = mu
    with torch.no_grad():
        for par in gate.parameters():
            par.mul_(30.0)  # a mix of binary and fractional bits
    x = None if p is None else torch.randn(*(batch or [6]), p, dtype=dtype)
    calls = _spy(monkeypatch)
    got = _gate_outputs(gate, x)
    assert calls == [1]
    with monkeypatch.context() as mp:
        _aten_only(mp)
        want = _gate_outputs(gate, x)
    assert calls == [1]  # the composed path did not take the host node
    tol = {"rtol": 1e-11, "atol": 1e-13} if dtype == F64 else {"rtol": 2e-5, "atol": 2e-6}
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("in_features", [None, 7])
@pytest.mark.parametrize(
    ("num_gates", "per_gate"), [(None, False), (2, False), (2, True)]
)  # one value per gate needs a bank
@pytest.mark.parametrize("lam_dtype", [torch.float32, F64])
def test_gate_host_path_is_bitwise_the_host_kernel_path(
    monkeypatch: pytest.MonkeyPatch,
    in_features: int | None,
    num_gates: int | None,
    lam_dtype: torch.dtype,
    per_gate: bool,
) -> None:
    """The one-node gate and the gate through dselect_k_fused (the same host kernel plus the
    loss written out) give identical numbers, values and gradients: one λ or one per gate, a
    λ buffer in the gate's dtype or in float64 (the loss then promotes)."""
    torch.manual_seed(0)
    lam: Any = [0.1, 0.4] if per_gate else 0.3
    gamma: Any = [1.0, 0.5] if per_gate else 0.8
    gate = DSelectK(64, 4, in_features=in_features, num_gates=num_gates, gamma=gamma)
    gate.register_buffer("_entropy_reg", torch.zeros(2 if per_gate else (), dtype=lam_dtype))
    gate.entropy_reg = lam
    with torch.no_grad():
        for par in gate.parameters():
            par.mul_(20.0)
    x = None if in_features is None else torch.randn(5, in_features)
    got = _gate_outputs(gate, x)
    monkeypatch.setattr(dispatch, "_small_on_host", lambda *a: False)  # gate as written
    assert dispatch._host_ok(gate.compute_logits(x))  # ... whose small kernel computes on the host
    want = _gate_outputs(gate, x)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gate_host_path_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    torch.manual_seed(0)
    gate = DSelectK(8, 2, in_features=4, entropy_reg=0.1)
    gate(torch.randn(3, 4))
    assert calls == [1]
    DSelectK(8, 2, in_features=4, distinct=True)(torch.randn(3, 4))  # distinct codes: as written
    DSelectK(5, 2, in_features=4)(torch.randn(3, 4))  # the unused-code penalty: as written
    limit = dispatch.HOST_GATE_MAX_ELEMENTS // (2 * 8)
    gate(
        torch.randn(dispatch.SMALL_MAX_ELEMENTS // (2 * 8) + 1, 4)
    )  # above the small kernel's size
    gate(torch.randn(limit, 4))
    assert calls == [1, 1, 1]
    gate(torch.randn(limit + 1, 4))  # too large
    gate.half()(torch.randn(3, 4).half())  # not float32/float64
    assert calls == [1, 1, 1]
    with monkeypatch.context() as mp:
        mp.setattr(dispatch, "FUSED_MIN_ELEMENTS", 0)  # the fused kernel everywhere: as written ...
        gate.float()(torch.randn(3, 4))
        assert calls == [1, 1, 1]
        gate(torch.randn(limit, 4))  # ... up to the small kernel's size
    assert calls == [1, 1, 1, 1]


@pytest.mark.parametrize("per_example", [False, True])
def test_gate_node_gradcheck(per_example: bool) -> None:
    torch.manual_seed(0)
    k, m = 2, 3
    lead = (4, 3) if per_example else (3,)
    logits = (torch.randn(*lead, k * (1 + m), dtype=F64) * 0.5).requires_grad_()
    gamma = torch.tensor([1.0, 0.7, 1.5], dtype=F64).expand(lead).reshape(-1)
    lam = torch.tensor([0.2, 0.0, 1.0], dtype=F64)

    def f(lg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = lg.reshape(-1, lg.shape[-1])
        w, aux, _ = _DSelectSmallGate.apply(flat, gamma, lam, k, lead, per_example)
        return w, aux

    assert gradcheck(f, (logits,))
    assert gradcheck(lambda lg: f(lg)[0], (logits,))
    assert gradcheck(lambda lg: f(lg)[1], (logits,))


def test_gate_host_path_only_weights_or_only_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    gate = DSelectK(16, 3, in_features=5, entropy_reg=0.3).double()
    x = torch.randn(4, 5, dtype=F64)
    for use in ("weights", "aux"):
        grads = []
        for aten in (False, True):
            with monkeypatch.context() as mp:
                if aten:
                    _aten_only(mp)
                out = gate(x)
                loss = (out.weights**2).sum() if use == "weights" else out.aux_loss
                grads.append(torch.autograd.grad(loss, list(gate.parameters())))
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


def test_gate_host_path_raises_on_changed_entropy_weight() -> None:
    """λ changed in place between forward and backward: an error, as in the composed path."""
    gate = DSelectK(8, 2, in_features=4, entropy_reg=0.1)
    out = gate(torch.randn(3, 4))
    gate._entropy_reg.fill_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.aux_loss.backward()
