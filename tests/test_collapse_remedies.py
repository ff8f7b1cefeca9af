"""DSelect-k collapse remedies (issue 14, docs/collapse.md): ``init="distinct"`` and exclusive
selectors; the default path is unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.autograd import gradcheck

from dselectk import functional as DF
from dselectk.gates import DSelectK
from dselectk.gates.dselect_k import exclusive_selectors

LAYOUTS = [(None, None), (None, 3), (5, None), (5, 3)]  # (in_features, num_gates)


def _laws(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g, dtype=dtype) * 2, dim=-1)


def _reference(r: torch.Tensor, eps: float) -> torch.Tensor:
    """The definition, selector by selector, code by code (no vectorisation)."""
    k, c = r.shape
    out = torch.zeros_like(r)
    held = torch.ones(c, dtype=r.dtype)
    for i in range(k):
        if i == 0:
            out[0] = r[0]
        else:
            num = [float(r[i, j] * held[j]) for j in range(c)]
            den = sum(num) + eps
            out[i] = torch.tensor([(num[j] + eps * float(r[i, j])) / den for j in range(c)])
        held = held * (1 - out[i])
    return out


def _one_hot(codes: list[int], c: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(codes), c).to(dtype)


# -- exclusive_selectors: the math ------------------------------------------------------------
@pytest.mark.parametrize("k,c", [(1, 2), (2, 4), (3, 8), (4, 16), (5, 8)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exclusive_matches_definition_and_is_a_law(k: int, c: int, seed: int) -> None:
    r = _laws(k, c, seed=seed)
    out = exclusive_selectors(r, eps=1e-3)
    torch.testing.assert_close(out, _reference(r, 1e-3))
    assert (out >= 0).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(k, dtype=r.dtype))
    torch.testing.assert_close(out[0], r[0])  # the first selector is untouched


def test_exclusive_batched_equals_per_row() -> None:
    r = _laws(2, 3, 4, 8)
    out = exclusive_selectors(r)
    for a in range(2):
        for b in range(3):
            torch.testing.assert_close(out[a, b], exclusive_selectors(r[a, b]))


@pytest.mark.parametrize("codes", [[0, 1, 2, 3], [5, 2, 7, 1], [3, 3, 1, 3], [4, 4, 4, 4]])
def test_exclusive_is_exact_on_binary_laws(codes: list[int]) -> None:
    """One-hot selectors (binary S(Z)): distinct or colliding, r̃ = r exactly (no 0/0)."""
    r = _one_hot(codes, 8)
    out = exclusive_selectors(r)
    assert torch.equal(out, r)
    assert torch.isfinite(out).all()


def test_exclusive_keeps_zeros_and_avoids_held_codes() -> None:
    r = _laws(3, 8, dtype=torch.float32)
    r[1, 2:5] = 0.0
    r[1] = r[1] / r[1].sum()
    out = exclusive_selectors(r)
    assert (out[1, 2:5] == 0).all()  # exact sparsity is preserved
    # selector 0 binary on code 6: later selectors put (almost) nothing there
    r[0] = _one_hot([6], 8)[0]
    out = exclusive_selectors(r)
    assert out[0, 6] == 1
    assert float(out[1:, 6].max()) < 1e-5
    torch.testing.assert_close(out.sum(-1), torch.ones(3))


def test_exclusive_rejects_nonpositive_eps() -> None:
    with pytest.raises(ValueError, match="eps"):
        exclusive_selectors(_laws(2, 4), eps=0.0)


@pytest.mark.parametrize("k,c", [(2, 4), (3, 8), (4, 16)])
def test_exclusive_gradcheck(k: int, c: int) -> None:
    r = _laws(k, c, seed=k).requires_grad_()
    assert gradcheck(lambda t: exclusive_selectors(t, eps=1e-3), (r,))
    assert gradcheck(lambda t: exclusive_selectors(t), (r,))


# -- the gate option --------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_defaults_unchanged(layout: tuple[Any, Any]) -> None:
    """Passing the new options at their defaults gives the same parameters and outputs."""
    in_features, num_gates = layout
    x = None if in_features is None else torch.randn(7, in_features)
    for init in ("paper", "spread"):
        torch.manual_seed(3)
        a = DSelectK(16, 4, in_features=in_features, num_gates=num_gates, gamma=2.0, init=init)
        torch.manual_seed(3)
        b = DSelectK(
            16,
            4,
            in_features=in_features,
            num_gates=num_gates,
            gamma=2.0,
            init=init,
            init_margin=0.25,
            exclusive=False,
        )
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
        oa, ob = a(x), b(x)
        assert torch.equal(oa.weights, ob.weights)
        assert torch.equal(oa.aux_loss, ob.aux_loss)
        assert repr(a) == repr(b)
        assert "exclusive" not in repr(a) and "init_margin" not in repr(a)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [16, 6])
def test_exclusive_gate_is_a_distribution_and_matches_composed(layout: Any, n: int) -> None:
    in_features, num_gates = layout
    torch.manual_seed(0)
    gate = DSelectK(
        n,
        3,
        in_features=in_features,
        num_gates=num_gates,
        gamma=1.0,
        entropy_reg=0.3,
        diversity=0.7,
        exclusive=True,
    )
    x = None if in_features is None else torch.randn(4, in_features)
    out = gate(x)
    assert (out.weights >= 0).all()
    total = out.weights.sum(-1)
    if n == 16:
        torch.testing.assert_close(total, torch.ones(total.shape))
    else:  # unreachable codes keep the rest of the mass, as in the paper's gate
        assert (total <= 1 + 1e-6).all()
    # by hand from the gate's logits
    alpha, z = gate.split_logits(gate.compute_logits(x))
    p = DF.smooth_step(z, 1.0)
    r = exclusive_selectors(DF.selector(p))
    w = (torch.softmax(alpha, -1).unsqueeze(-1) * r).sum(-2)[..., :n]
    torch.testing.assert_close(out.weights, w)
    # the auxiliary loss is the default gate's (raw S(Z)), selectors exclusive or not
    plain = DSelectK(
        n,
        3,
        in_features=in_features,
        num_gates=num_gates,
        gamma=1.0,
        entropy_reg=0.3,
        diversity=0.7,
    )
    plain.load_state_dict(gate.state_dict())
    torch.testing.assert_close(out.aux_loss, plain(x).aux_loss)


@pytest.mark.parametrize("codes", [[1, 4, 7], [2, 2, 5]])
def test_exclusive_gate_equals_paper_gate_once_binary(codes: list[int]) -> None:
    """Binary S(Z): exclusive weights == the paper's weights, bit for bit (distinct codes), and
    exactly k-sparse; a collision falls back to the paper's weights too."""
    gate = DSelectK(8, 3, gamma=1.0, exclusive=True)
    plain = DSelectK(8, 3, gamma=1.0)
    with torch.no_grad():
        bits = (torch.tensor(codes).unsqueeze(-1) >> torch.arange(3)) & 1
        gate.z.copy_((bits.float() * 2 - 1) * 3.0)  # |z| > γ/2: binary
        gate.alpha.copy_(torch.tensor([0.3, -0.2, 0.5]))
    plain.load_state_dict(gate.state_dict())
    assert bool(gate.is_binary())
    w = gate().weights
    torch.testing.assert_close(w, plain().weights, rtol=0, atol=1e-7)
    assert int((w > 0).sum()) == len(set(codes))


def test_exclusive_gate_gradcheck() -> None:
    for in_features in (None, 3):
        torch.manual_seed(1)
        gate = DSelectK(
            6,
            3,
            in_features=in_features,
            num_gates=2,
            gamma=4.0,
            entropy_reg=0.2,
            diversity=0.5,
            exclusive=True,
        ).double()
        x = None if in_features is None else torch.randn(4, 3, dtype=torch.float64)

        def f(logits: torch.Tensor, gate: DSelectK = gate) -> tuple[torch.Tensor, torch.Tensor]:
            out = gate.gate(logits)
            return out.weights, out.aux_loss

        logits = gate.compute_logits(x).detach().requires_grad_()
        assert gradcheck(f, (logits,))


def test_exclusive_breaks_the_lockstep_gradient() -> None:
    """Selector 0 concentrated on a code: selector 1's data gradient no longer pulls it there."""
    gate = DSelectK(8, 2, gamma=1.0, exclusive=True)
    with torch.no_grad():
        gate.z[0] = torch.tensor([0.45, 0.45, 0.45])  # S ≈ 0.99: selector 0 on code 7
        gate.z[1] = torch.tensor([0.01, -0.01, 0.0])
        gate.alpha.zero_()
    target = torch.zeros(8)
    target[7] = 1.0  # the loss rewards weight on code 7
    g_plain = DSelectK(8, 2, gamma=1.0)
    g_plain.load_state_dict(gate.state_dict())
    grads = []
    for g in (gate, g_plain):
        (-(g().weights * target).sum()).backward()
        assert g.logits.grad is not None
        grads.append(g.split_logits(g.logits.grad)[1][1])  # dL/dz of selector 1
    # without exclusion selector 1 is pushed towards code 7 (all its bits up) ...
    assert (grads[1] < 0).all()
    # ... with exclusion hardly at all
    assert float(grads[0].abs().max()) < 0.05 * float(grads[1].abs().max())


# -- init="distinct" --------------------------------------------------------------------------
def _codes(gate: DSelectK, x: torch.Tensor | None = None) -> torch.Tensor:
    p = gate.bits(x)
    return ((p > 0.5).long() * 2 ** torch.arange(gate.num_bits)).sum(-1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,k", [(16, 4), (8, 2), (6, 3), (5, 5), (32, 7)])
def test_distinct_init_codes(layout: Any, n: int, k: int) -> None:
    in_features, num_gates = layout
    torch.manual_seed(n * k)
    gate = DSelectK(n, k, in_features=in_features, num_gates=num_gates, gamma=3.0, init="distinct")
    # per-example: the bias carries the offset, the weights are tiny; x = 0 reads the bias
    x = None if in_features is None else torch.zeros(2, in_features)
    codes = _codes(gate, x).reshape(-1, k)
    for row in codes.tolist():
        assert len(set(row)) == k  # distinct
        assert max(row) < n  # reachable
        if n == 2**gate.num_bits and k == 2:
            assert bin(row[0] ^ row[1]).count("1") == gate.num_bits  # antipodal
    p = gate.bits(x)
    assert ((p > 0) & (p < 1)).all()  # not binary: still trainable


def test_distinct_init_margin_sets_the_strength() -> None:
    for margin in (0.1, 0.25, 0.4):
        torch.manual_seed(0)
        gate = DSelectK(16, 4, gamma=10.0, init="distinct", init_margin=margin)
        s = float(DF.smooth_step(torch.tensor(margin * 10.0), 10.0))
        dist = (gate.bits() - 0.5).abs()
        # offset ±margin·γ plus the paper's U(±γ/100) noise
        lo = float(DF.smooth_step(torch.tensor(margin * 10.0 - 0.1), 10.0)) - 0.5
        hi = float(DF.smooth_step(torch.tensor(margin * 10.0 + 0.1), 10.0)) - 0.5
        assert lo - 1e-6 <= float(dist.min()) and float(dist.max()) <= hi + 1e-6
        assert abs(float(dist.mean()) - (s - 0.5)) < 0.02
    for bad in (0.0, 0.5, -1.0):
        with pytest.raises(ValueError, match="init_margin"):
            DSelectK(16, 4, init="distinct", init_margin=bad)


def test_distinct_init_per_gate_gamma() -> None:
    torch.manual_seed(0)
    gate = DSelectK(16, 4, num_gates=2, gamma=[1.0, 10.0], init="distinct", init_margin=0.3)
    z = gate.z.detach().abs()
    assert torch.allclose(z[0], torch.full((4, 4), 0.3), atol=0.011)
    assert torch.allclose(z[1], torch.full((4, 4), 3.0), atol=0.11)
    assert "init='distinct', init_margin=0.3" in repr(gate)


@pytest.mark.parametrize("exclusive", [False, True])
def test_alpha_floor(exclusive: bool) -> None:
    torch.manual_seed(0)
    gate = DSelectK(8, 3, gamma=1.0, alpha_floor=0.4, exclusive=exclusive, num_gates=2)
    with torch.no_grad():
        gate.alpha.copy_(torch.tensor([[30.0, -30.0, 0.0], [0.0, 1.0, 2.0]]))
    alpha, z = gate.split_logits(gate.logits)
    r = DF.selector(DF.smooth_step(z, 1.0))
    if exclusive:
        r = exclusive_selectors(r)
    share = 0.6 * torch.softmax(alpha, -1) + 0.4 / 3
    assert float(share.detach().min()) >= 0.4 / 3 - 1e-7  # no starved selector
    torch.testing.assert_close(gate().weights, (share.unsqueeze(-1) * r).sum(-2))
    assert "alpha_floor=0.4" in repr(gate)
    # binary S(Z): still at most k experts
    with torch.no_grad():
        gate.z.copy_(torch.sign(gate.z) * 2.0)
    assert int((gate().weights > 0).sum(-1).max()) <= 3
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="alpha_floor"):
            DSelectK(8, 3, alpha_floor=bad)


def test_alpha_floor_gradcheck_and_off_by_default() -> None:
    torch.manual_seed(2)
    gate = DSelectK(6, 3, in_features=3, gamma=4.0, entropy_reg=0.2, alpha_floor=0.3).double()
    logits = gate.compute_logits(torch.randn(4, 3, dtype=torch.float64)).detach()
    assert gradcheck(lambda t: gate.gate(t).weights, (logits.requires_grad_(),))
    assert DSelectK(6, 3).alpha_floor == 0.0
