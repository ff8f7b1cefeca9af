"""The smooth-step's leaky straight-through gradient (issue 23 screen): ``smooth_step(t, γ,
leak=ε)`` has the values of S and the gradient max(S'(t), ε·S'(0)); ``DSelectK(leak=ε)`` computes
the same weights as the plain gate on a path that honours the leak (never a host or fused kernel,
which compute the exact derivative); the token-moe study passes it to DSelect-k routers only."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dselectk import functional as DF
from dselectk.cli import main
from dselectk.experiments import token_moe as TM
from dselectk.experiments.token_moe.recipe import LATER, TokenMoEConfig
from dselectk.gates import DSelectK

_TINY = dict(d_model=16, d_ff=16, heads=2, num_experts=4, seq_len=8)


def _slope(t: torch.Tensor, gamma: float) -> torch.Tensor:
    """The exact S'(t): (1.5 - 6 (t/γ)²)/γ inside |t| < γ/2, else 0."""
    s = t / gamma
    return torch.where(s.abs() < 0.5, (1.5 - 6.0 * s * s) / gamma, torch.zeros_like(s))


def _grad(t: torch.Tensor, gamma: float, leak: float) -> torch.Tensor:
    t = t.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(DF.smooth_step(t, gamma, leak).sum(), t)
    return g


# points inside and outside the flat region (γ = 1 and 2), the edges included
_T = torch.tensor([-3.0, -0.7, -0.5, -0.49, -0.45, -0.3, 0.0, 0.1, 0.4, 0.47, 0.5, 0.6, 5.0])


@pytest.mark.parametrize("gamma", [1.0, 2.0])
@pytest.mark.parametrize("leak", [0.02, 0.1, 1.0])
def test_values_are_the_smooth_step_exactly(gamma: float, leak: float) -> None:
    t = (_T * gamma).double()
    leaky = DF.smooth_step(t.clone().requires_grad_(True), gamma, leak)
    assert torch.equal(leaky.detach(), DF.smooth_step(t, gamma))
    assert bool(((leaky == 0) | (leaky == 1)).sum() >= 6)  # the flat points stay exactly 0/1
    f32 = (_T * gamma).requires_grad_(True)
    assert torch.equal(DF.smooth_step(f32, gamma, leak).detach(), DF.smooth_step(f32, gamma))


@pytest.mark.parametrize("gamma", [1.0, 2.0])
@pytest.mark.parametrize("leak", [0.02, 0.1, 1.0])
def test_gradient_is_max_of_the_slope_and_the_leak(gamma: float, leak: float) -> None:
    t = (_T * gamma).double()
    want = torch.maximum(_slope(t, gamma), torch.full_like(t, leak * 1.5 / gamma))
    torch.testing.assert_close(_grad(t, gamma, leak), want, rtol=1e-12, atol=1e-15)
    flat = t.abs() >= gamma / 2
    assert bool((_grad(t, gamma, leak)[flat] > 0).all())  # the way S grows, on both sides
    # a per-entry γ tensor broadcasts as in the exact smooth-step
    g = torch.full_like(t, gamma)
    tt = t.clone().requires_grad_(True)
    (got,) = torch.autograd.grad(DF.smooth_step(tt, g, leak).sum(), tt)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


def test_gradient_matches_finite_differences_inside_the_smooth_region() -> None:
    """Where S'(t) > ε·S'(0) the leak changes nothing: the exact, numerically checked slope."""
    t = torch.tensor([-0.35, -0.2, 0.0, 0.15, 0.33], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: DF.smooth_step(x, 1.0, 0.1), (t,))
    # near the edges the slope is below ε·S'(0): the surrogate takes over there
    edge = torch.tensor([0.49], dtype=torch.float64)
    assert _grad(edge, 1.0, 0.1).item() == pytest.approx(0.15)
    assert _slope(edge, 1.0).item() < 0.15


def test_zero_leak_is_todays_gradient() -> None:
    t = torch.linspace(-2, 2, 41, dtype=torch.float64)
    for leak in (0.0, 0):
        torch.testing.assert_close(_grad(t, 1.0, leak), _slope(t, 1.0), rtol=0, atol=1e-15)
    tt = t.clone().requires_grad_(True)
    (today,) = torch.autograd.grad(DF.smooth_step(tt, 1.0).sum(), tt)
    assert torch.equal(today, _grad(t, 1.0, 0.0))


@pytest.mark.parametrize("bad", [-0.01, math.nan, math.inf, "0.1", None, True])
def test_bad_leak_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="leak"):
        DF.smooth_step(torch.zeros(3), 1.0, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="leak"):
        DSelectK(8, 2, in_features=4, leak=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="leak"):
        DF.dselect_k_fused(torch.zeros(2), torch.zeros(2, 3), 1.0, bad)  # type: ignore[arg-type]


# -- the gate ------------------------------------------------------------------------------------
def _pair(leak: float, **kw: object) -> tuple[DSelectK, DSelectK]:
    torch.manual_seed(0)
    plain = DSelectK(8, 2, gamma=1.0, entropy_reg=0.01, **kw)  # type: ignore[arg-type]
    leaky = DSelectK(8, 2, gamma=1.0, entropy_reg=0.01, leak=leak, **kw)  # type: ignore[arg-type]
    leaky.load_state_dict(plain.state_dict())
    with torch.no_grad():  # spread the logits so that many bits are binary
        for g in (plain, leaky):
            for p in g.parameters():
                p.mul_(200.0)
    return plain, leaky


@pytest.mark.parametrize("distinct", [False, True])
@pytest.mark.parametrize("batch", [3, 700])  # small (host kernels) and large (fused kernel)
def test_per_example_gate_same_output_and_a_gradient_where_binary(
    distinct: bool, batch: int
) -> None:
    plain, leaky = _pair(0.1, in_features=6, distinct=distinct)
    assert set(leaky.state_dict()) == set(plain.state_dict())  # the leak is no state
    assert "leak=0.1" in repr(leaky) and "leak" not in repr(plain)
    x = torch.randn(batch, 6)
    a, b = plain(x), leaky(x)
    torch.testing.assert_close(b.weights, a.weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b.aux_loss, a.aux_loss, rtol=1e-6, atol=1e-7)
    binary = leaky.binary_entries(x).all(-1)  # examples whose every bit is flat
    assert bool(binary.any())
    head = torch.randn(8)
    for g in (plain, leaky):
        g.zero_grad()
        (g(x).weights @ head).sum().backward()
    z_rows = slice(2, None)  # the Z rows of the fused layer (α rows first)
    gw_plain = plain.proj.weight.grad  # type: ignore[union-attr]
    gw_leaky = leaky.proj.weight.grad  # type: ignore[union-attr]
    assert gw_plain is not None and gw_leaky is not None
    # only the binary examples: the exact gradient on Z is 0, the leaky one is not
    xb = x[binary]
    for g in (plain, leaky):
        g.zero_grad()
        (g(xb).weights @ head).sum().backward()
    assert plain.proj.weight.grad[z_rows].abs().max() == 0  # type: ignore[union-attr,index]
    assert leaky.proj.weight.grad[z_rows].abs().max() > 0  # type: ignore[union-attr,index]


def test_static_gate_same_output_and_a_gradient_where_binary() -> None:
    plain, leaky = _pair(0.02)
    for g in (plain, leaky):
        g.set_selection(torch.tensor([1, 5]))  # every bit at ±γ: flat
    a, b = plain(), leaky()
    torch.testing.assert_close(b.weights, a.weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b.aux_loss, a.aux_loss, rtol=1e-6, atol=1e-7)
    assert bool(leaky.is_binary())
    head = torch.randn(8)
    (plain().weights @ head).backward()
    (leaky().weights @ head).backward()
    assert plain.logits.grad is not None and leaky.logits.grad is not None
    assert plain.logits.grad[2:].abs().max() == 0 and leaky.logits.grad[2:].abs().max() > 0
    torch.testing.assert_close(leaky.logits.grad[:2], plain.logits.grad[:2])  # α: unchanged


def test_leak_never_takes_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ε > 0 the host nodes (NumPy, numba) and the fused/small kernels are not called."""
    from dselectk import _kernels, _numba_nodes
    from dselectk.gates import dselect_k as gate_module

    def boom(*args: object, **kw: object) -> None:
        raise AssertionError("a kernel with the exact derivative was called")

    for mod, names in (
        (gate_module, ("_DSelectSmallGate", "_DSelectSmallGateLinear", "_NumbaGate",
                       "_NumbaGateLinear")),
        (DF, ("_DSelectSmall", "_DSelectFused")),
        (_kernels, ()),
        (_numba_nodes, ()),
    ):  # fmt: skip
        for name in names:
            monkeypatch.setattr(getattr(mod, name), "apply", boom)
    monkeypatch.setattr(DF, "_small_eager", boom)
    for kernel in ("numpy", "numba", "aten"):
        monkeypatch.setenv("DSELECTK_KERNEL", kernel)
        for batch in (3, 700):
            _, leaky = _pair(0.1, in_features=6)
            out = leaky(torch.randn(batch, 6)).weights
            out.sum().backward()
        _, static = _pair(0.1)
        static().weights.sum().backward()
        _, dist = _pair(0.1, in_features=6, distinct=True)
        dist(torch.randn(700, 6)).weights.sum().backward()


# -- the study -----------------------------------------------------------------------------------
def test_study_passes_the_leak_to_dselect_k_routers_only(tmp_path: Path) -> None:
    assert "smooth_step_leak" in LATER and TM.DEFAULTS["smooth_step_leak"] == 0.0
    assert "smooth_step_leak" not in TokenMoEConfig(out=tmp_path).record_hparams()
    ident = TokenMoEConfig(out=tmp_path, smooth_step_leak=0.02).record_hparams()
    assert ident["smooth_step_leak"] == 0.02
    hp = dict(TM.DEFAULTS, **_TINY)
    for name in ("dselect_k", "dselect_k_distinct"):
        model = TM.build_model(TM.ROUTERS[name], dict(hp, smooth_step_leak=0.1))
        assert all(m.router.leak == 0.1 for m in model.moe_layers)
        assert all(m.router.leak == 0.0 for m in TM.build_model(TM.ROUTERS[name], hp).moe_layers)
    # Top-k: the same model, parameters and gradients with or without the setting
    torch.manual_seed(3)
    plain = TM.build_model(TM.ROUTERS["topk"], hp)
    torch.manual_seed(3)
    flagged = TM.build_model(TM.ROUTERS["topk"], dict(hp, smooth_step_leak=0.1))
    assert repr(plain) == repr(flagged)
    for (k1, v1), (k2, v2) in zip(plain.state_dict().items(), flagged.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    plain.loss(x, y).backward()
    flagged.loss(x, y).backward()
    for p1, p2 in zip(plain.parameters(), flagged.parameters()):
        g1, g2 = p1.grad, p2.grad
        assert (g1 is None and g2 is None) or (g1 is not None and g2 is not None and g1.equal(g2))


def test_cli_records_the_leak_only_when_set(tmp_path: Path) -> None:
    base = ["reproduce", "token-moe", "--seeds", "1", "--steps", "12", "--batch-size", "4",
            "--d-model", "16", "--d-ff", "16", "--num-experts", "4", "--corpus-bytes", "40000",
            "--seq-len", "16", "--val-windows", "8", "--jobs", "1", "--no-progress",
            "--gates", "dselect_k_distinct"]  # fmt: skip
    assert main([*base, "--out", str(tmp_path / "d")]) == 0
    assert main([*base, "--out", str(tmp_path / "o"), "--smooth-step-leak", "0.1"]) == 0
    for name, has in (("d", False), ("o", True)):
        (rec,) = [json.loads(p.read_text()) for p in (tmp_path / name / "runs").glob("*.json")]
        assert ("smooth_step_leak" in rec["config"]["hparams"]) is has
        assert math.isfinite(rec["metrics"]["val_bpc"])
    with pytest.raises(SystemExit):
        main([*base, "--out", str(tmp_path / "x"), "--smooth-step-leak", "-1"])
