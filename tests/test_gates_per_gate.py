"""Per-gate hyperparameters of gate banks, and the selector-diversity penalty of DSelect-k
(:class:`~dselectk.gates.DSelectKExtended`).

A bank (``num_gates=T``) may hold one γ, λ, τ, μ per gate. Checked here: the bank computes,
gate for gate, what T single gates with those values compute (static and per-example banks);
the numbers are bit-identical to the per-member gate classes the synthetic experiment used
before they moved into the library (frozen copies below); assignment, validation, state_dict and
schedules; and the diversity penalty against an explicit expansion of the 2**M code laws.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dselectk import functional as DF
from dselectk.gates import DSelectK, DSelectKExtended, GumbelSoftmaxGate, SoftmaxSelectorGate
from dselectk.gates.base import GateOutput, HyperParameter
from dselectk.kernels import dispatch as KD
from dselectk.kernels.aten import _SelectorGate
from dselectk.schedules import AttributeScheduler, GeometricSchedule, LinearSchedule

F64 = torch.float64
T, P, B = 4, 5, 6
GAMMAS = [0.5, 1.25, 3.0, 0.3]
LAMBDAS = [0.0, 0.3, 1.0, 0.05]
TEMPS = [1.0, 0.05, 0.3, 2.0]


@pytest.fixture(params=["kernel", "composed"])
def dispatch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through the fused kernel and through the composed small-problem path (the
    NumPy host kernel's dispatch: the numba kernel, when installed, takes the gate at every size
    and is checked against these paths to float rounding in tests/test_numba_kernel.py)."""
    monkeypatch.setattr(KD, "FUSED_MIN_ELEMENTS", 0 if request.param == "kernel" else 10**9)
    monkeypatch.setenv("DSELECTK_KERNEL", "numpy")
    return str(request.param)


# -- frozen references: the per-member gates of experiments/synthetic.py (before the move) -------


class RefMemberDSelectK(DSelectK):
    """Copy of ``_MemberDSelectK``: γ and λ as (G,) buffers set after construction."""

    member_gamma: torch.Tensor
    member_entropy_reg: torch.Tensor

    def set_members(self, gamma: torch.Tensor, entropy_reg: torch.Tensor) -> None:
        self.register_buffer("member_gamma", gamma.to(self.logits))
        self.register_buffer("member_entropy_reg", entropy_reg.to(self.logits))

    def gate(self, logits: torch.Tensor) -> GateOutput:
        alpha, z = self.split_logits(logits)
        w, ent = KD.dselect_k_fused(alpha, z, self.member_gamma)
        return GateOutput(w, self._reduce_aux(self.member_entropy_reg * ent.sum(dim=-1)))

    @torch.no_grad()
    def bits(self, x: torch.Tensor | None = None) -> torch.Tensor:
        _, z = self.split_logits(self.compute_logits(x))
        return DF.smooth_step(z, self.member_gamma[:, None, None])


class RefMemberSelectorGate(SoftmaxSelectorGate):
    """Copy of ``_MemberSelectorGate``: τ and λ as (G,) buffers."""

    member_temperature: torch.Tensor
    member_entropy_reg: torch.Tensor

    def set_members(self, temperature: torch.Tensor, entropy_reg: torch.Tensor) -> None:
        self.register_buffer("member_temperature", temperature.to(self.logits))
        self.register_buffer("member_entropy_reg", entropy_reg.to(self.logits))

    def selectors(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        alpha = logits[..., : self.k]
        beta = logits[..., self.k :].unflatten(-1, (self.k, self.num_experts))
        tau = self.member_temperature[:, None, None]
        return torch.softmax(alpha, dim=-1), torch.softmax(beta / tau, dim=-1)

    def gate(self, logits: torch.Tensor) -> GateOutput:
        tau = self.member_temperature[:, None, None]
        weights, ent = _SelectorGate.apply(logits, tau, self.k)[:2]
        return GateOutput(weights, self._reduce_aux(self.member_entropy_reg * ent.sum(dim=-1)))


class RefDiverseDSelectK(DSelectK):
    """Copy of ``DiverseDSelectK`` (μ a Python float; the library gate underneath has μ = 0)."""

    def __init__(self, *args: Any, diversity: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ref_diversity = float(diversity)

    def gate(self, logits: torch.Tensor) -> Any:
        out = super().gate(logits)
        if self.ref_diversity <= 0:
            return out
        _, z = self.split_logits(logits)
        p = (z / self._gamma).clamp(-0.5, 0.5)
        p = p * (1.5 - 2.0 * p * p) + 0.5  # S(z), (*lead, K, M)
        pi, pj = p.unsqueeze(-2), p.unsqueeze(-3)  # (*lead, K, 1, M), (*lead, 1, K, M)
        same = (pi * pj + (1 - pi) * (1 - pj)).prod(-1)  # (*lead, K, K)
        k = p.shape[-2]
        upper = torch.ones(k, k, dtype=torch.bool, device=p.device).triu(1)
        per_gate = self.ref_diversity * (same * upper).sum((-1, -2))
        return type(out)(out.weights, out.aux_loss + self._reduce_aux(per_gate))


def _outputs_and_grads(gate: Any, logits: torch.Tensor, seed: int = 3) -> list[torch.Tensor]:
    """Weights, aux loss and the grad of the logits of a fixed random loss."""
    logits = logits.detach().clone().requires_grad_()
    out = gate.gate(logits)
    g = torch.randn(out.weights.shape, generator=torch.Generator().manual_seed(seed))
    loss = (out.weights * g.to(out.weights)).sum() + out.aux_loss
    (grad,) = torch.autograd.grad(loss, logits)
    return [out.weights.detach(), out.aux_loss.detach(), grad]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _spread(gate: Any, scale: float = 30.0) -> None:
    """Scale the parameters: a mix of fractional and binary bits (and peaked selectors)."""
    with torch.no_grad():
        for p in gate.parameters():
            p.mul_(scale)


# -- bit-identical to the per-member classes ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("in_features", [None, P])
@pytest.mark.parametrize("n", [8, 32])
def test_dselect_k_per_gate_bitwise_equals_member_gate(
    dispatch: str, dtype: torch.dtype, in_features: int | None, n: int
) -> None:
    gammas = torch.tensor(GAMMAS, dtype=F64)
    lams = torch.tensor(LAMBDAS, dtype=F64)
    torch.manual_seed(0)
    lib = DSelectK(n, 3, in_features=in_features, num_gates=T, gamma=gammas, entropy_reg=lams)
    ref = RefMemberDSelectK(n, 3, in_features=in_features, num_gates=T)
    lib, ref = lib.to(dtype), ref.to(dtype)
    # set in the model's dtype (the reference's per-example buffers keep the given dtype)
    lib.gamma, lib.entropy_reg = gammas, lams
    ref.set_members(gammas.to(dtype), lams.to(dtype))
    _spread(lib)
    ref.load_state_dict(lib.state_dict(), strict=False)  # the parameters
    x = None if in_features is None else torch.randn(B, P, dtype=dtype)
    logits = lib.compute_logits(x)
    _assert_equal(_outputs_and_grads(lib, logits), _outputs_and_grads(ref, logits))
    torch.testing.assert_close(lib.bits(x), ref.bits(x), rtol=0, atol=0)
    torch.testing.assert_close(lib(x).weights, ref(x).weights, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("in_features", [None, P])
def test_selector_gate_per_gate_bitwise_equals_member_gate(
    dtype: torch.dtype, in_features: int | None
) -> None:
    temps = torch.tensor(TEMPS, dtype=F64)
    lams = torch.tensor(LAMBDAS, dtype=F64)
    torch.manual_seed(0)
    kw: dict[str, Any] = {"in_features": in_features, "num_gates": T, "init_std": 1.0}
    lib = SoftmaxSelectorGate(8, 2, temperature=temps, entropy_reg=lams, **kw).to(dtype)
    lib.temperature, lib.entropy_reg = temps, lams  # in the model's dtype
    ref = RefMemberSelectorGate(8, 2, **kw).to(dtype)
    ref.set_members(temps.to(dtype), lams.to(dtype))
    ref.load_state_dict(lib.state_dict(), strict=False)
    x = None if in_features is None else torch.randn(B, P, dtype=dtype)
    logits = lib.compute_logits(x)
    _assert_equal(_outputs_and_grads(lib, logits), _outputs_and_grads(ref, logits))
    for a, b in zip(lib.selectors(logits), ref.selectors(logits), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(lib.hard_weights(x), ref.hard_weights(x), rtol=0, atol=0)


# -- a bank equals T single gates ------------------------------------------------------------------


def _bank_vs_singles(bank: Any, singles: list[Any], x: torch.Tensor | None) -> None:
    """Weights, per-gate aux losses and logit grads of bank gate t equal single gate t's."""
    logits = bank.compute_logits(x).detach()
    got = _outputs_and_grads(bank, logits)
    aux_sum = torch.zeros((), dtype=F64)
    for t, single in enumerate(singles):
        lg = logits[..., t, :]
        g = torch.randn(got[0].shape, generator=torch.Generator().manual_seed(3))[..., t, :]
        lg = lg.clone().requires_grad_()
        out = single.gate(lg)
        (grad,) = torch.autograd.grad((out.weights * g.to(F64)).sum() + out.aux_loss, lg)
        # float64 rounding only (the kernels vectorise over the gates in another order)
        torch.testing.assert_close(got[0][..., t, :], out.weights, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(got[2][..., t, :], grad, rtol=1e-13, atol=1e-14)
        aux_sum = aux_sum + out.aux_loss.detach()
    torch.testing.assert_close(got[1], aux_sum, rtol=1e-14, atol=0)


@pytest.mark.parametrize("in_features", [None, P])
@pytest.mark.parametrize("n", [8, 5])
def test_dselect_k_bank_equals_single_gates(dispatch: str, in_features: int | None, n: int) -> None:
    per_gate = {"gamma": GAMMAS, "entropy_reg": LAMBDAS, "diversity": [0.0, 0.5, 2.0, 0.1]}
    torch.manual_seed(0)
    bank = DSelectKExtended(n, 3, in_features=in_features, num_gates=T, xi=0.2).double()
    for key, vals in per_gate.items():  # set after .double(): exact float64 values
        setattr(bank, key, vals)
    _spread(bank, 20.0)
    singles = []
    for t in range(T):
        single = DSelectKExtended(n, 3, in_features=in_features, xi=0.2).double()
        for key, vals in per_gate.items():
            setattr(single, key, vals[t])
        singles.append(single)
    x = None if in_features is None else torch.randn(B, P, dtype=F64)
    _bank_vs_singles(bank, singles, x)
    bits = bank.bits(x)
    for t, single in enumerate(singles):
        z = single.split_logits(bank.compute_logits(x)[..., t, :])[1]
        torch.testing.assert_close(bits[..., t, :, :], DF.smooth_step(z, GAMMAS[t]))


@pytest.mark.parametrize("in_features", [None, P])
def test_selector_gate_bank_equals_single_gates(in_features: int | None) -> None:
    torch.manual_seed(0)
    kw: dict[str, Any] = {"in_features": in_features, "init_std": 1.0}
    bank = SoftmaxSelectorGate(8, 2, num_gates=T, **kw).double()
    bank.temperature, bank.entropy_reg = TEMPS, LAMBDAS
    singles = [
        SoftmaxSelectorGate(8, 2, temperature=tau, entropy_reg=lam, **kw).double()
        for tau, lam in zip(TEMPS, LAMBDAS, strict=True)
    ]
    for s, tau, lam in zip(singles, TEMPS, LAMBDAS, strict=True):
        s.temperature, s.entropy_reg = tau, lam  # exact float64 values after .double()
    x = None if in_features is None else torch.randn(B, P, dtype=F64)
    _bank_vs_singles(bank, singles, x)


@pytest.mark.parametrize("in_features", [None, P])
def test_gumbel_gate_bank_equals_single_gates(in_features: int | None) -> None:
    torch.manual_seed(0)
    bank = GumbelSoftmaxGate(8, in_features=in_features, num_gates=T, hard=False).double()
    bank.temperature, bank.sparsity_reg = TEMPS, LAMBDAS
    with torch.no_grad():
        for p in bank.parameters():
            p.add_(torch.randn_like(p))
    x = None if in_features is None else torch.randn(B, P, dtype=F64)
    logits = bank.compute_logits(x).detach()
    torch.manual_seed(7)
    out = bank.gate(logits)  # training mode: relaxed samples with the per-gate τ
    torch.manual_seed(7)
    u = torch.rand(logits[..., 8:].shape, dtype=F64).clamp(1e-6, 1 - 1e-6)
    alpha, keep = logits[..., :8], logits[..., 8:]
    tau = torch.tensor(TEMPS, dtype=F64)[:, None]
    soft = torch.sigmoid((keep + torch.log(u) - torch.log1p(-u)) / tau)
    torch.testing.assert_close(out.weights, torch.softmax(alpha, -1) * soft, rtol=0, atol=0)
    bank.eval()
    penalty = torch.tensor(LAMBDAS, dtype=F64) * torch.nn.functional.logsigmoid(keep).sum(-1)
    torch.testing.assert_close(bank.gate(logits).aux_loss, bank._reduce_aux(penalty))
    single = GumbelSoftmaxGate(8, sparsity_reg=LAMBDAS[2], temperature=TEMPS[2]).double().eval()
    torch.testing.assert_close(
        single.gate(logits[..., 2, :]).weights, bank.gate(logits)[0][..., 2, :], rtol=0, atol=0
    )


# -- initialisation -----------------------------------------------------------------------------


@pytest.mark.parametrize("in_features", [None, P])
def test_dselect_k_init_uses_each_gates_gamma(in_features: int | None) -> None:
    gammas = [1.0, 100.0, 10.0, 0.01]
    torch.manual_seed(0)
    bank = DSelectK(8, 2, in_features=in_features, num_gates=T, gamma=gammas)
    rows = bank.logits if in_features is None else bank.proj.weight.view(T, -1, P)
    others = [] if in_features is None else [bank.proj.bias.view(T, -1)]
    for group in [rows, *others]:
        for t, g in enumerate(gammas):
            bound = torch.tensor(g, dtype=torch.float32).item() / 100
            assert group[t].abs().max() <= bound
            assert group[t].abs().max() > bound / 2  # drawn at that scale, not a smaller one
    assert ((bank.bits(None if in_features is None else torch.randn(9, P)) % 1) > 0).all()


@pytest.mark.parametrize("in_features", [None, P])
@pytest.mark.parametrize("init", ["paper", "spread"])
def test_dselect_k_init_equal_per_gate_values_draw_like_a_scalar(
    in_features: int | None, init: str
) -> None:
    """Equal per-gate values draw the very numbers of the scalar bank (row by row, same order)."""
    kw: dict[str, Any] = {"in_features": in_features, "num_gates": T, "init": init}
    torch.manual_seed(0)
    scalar = DSelectKExtended(8, 2, gamma=0.5, **kw)
    torch.manual_seed(0)
    per_gate = DSelectKExtended(8, 2, gamma=[0.5] * T, **kw)
    for a, b in zip(scalar.parameters(), per_gate.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dselect_k_scalar_init_draws_as_before() -> None:
    """The scalar bank's draw: one U(-γ/100, γ/100) over the (T, K(1+M)) parameter."""
    torch.manual_seed(0)
    gate = DSelectK(8, 2, num_gates=T, gamma=0.7)
    torch.manual_seed(0)
    want = torch.zeros(T, 8).uniform_(
        -float(torch.tensor(0.7)) / 100, float(torch.tensor(0.7)) / 100
    )
    torch.testing.assert_close(gate.logits.detach(), want, rtol=0, atol=0)


# -- assignment, reading, validation --------------------------------------------------------------


def test_float_tensor_float_assignment() -> None:
    gate = DSelectK(8, 2, num_gates=3, gamma=2.0)
    assert isinstance(gate.gamma, float) and gate.gamma == 2.0
    assert gate._gamma.shape == ()
    gate.gamma = [0.5, 1.0, 2.0]  # a sequence: one value per gate
    value = gate.gamma
    assert isinstance(value, torch.Tensor) and value.tolist() == [0.5, 1.0, 2.0]
    assert gate._gamma.shape == (3,)
    value[0] = 7.0  # reading returns a copy
    assert gate.gamma.tolist() == [0.5, 1.0, 2.0]
    buf = gate._gamma
    gate.gamma = torch.tensor([1.0, 3.0, 4.0], dtype=F64)  # a (T,) tensor: copied in place
    assert gate._gamma is buf and gate.gamma.tolist() == [1.0, 3.0, 4.0]
    gate.gamma = 2.5  # a number fills every gate, in place (the schedules' case)
    assert gate._gamma is buf and gate.gamma.tolist() == [2.5, 2.5, 2.5]
    gate.gamma = torch.tensor(1.5)  # a 0-d tensor: one value again
    assert gate._gamma.shape == () and gate.gamma == 1.5 and isinstance(gate.gamma, float)
    scalar_buf = gate._gamma
    gate.gamma = 0.25
    assert gate._gamma is scalar_buf and gate.gamma == 0.25
    gate().weights.sum().backward()


def test_per_gate_buffers_keep_dtype_and_follow_to() -> None:
    gate = DSelectK(8, 2, num_gates=3, gamma=[0.5, 1.0, 2.0]).double()
    assert gate._gamma.dtype == F64 and gate._entropy_reg.dtype == F64
    gate.gamma = [0.1, 0.2, 0.3]  # float64 buffer: the exact doubles
    assert gate.gamma.tolist() == [0.1, 0.2, 0.3]
    gate.gamma = torch.tensor(0.1, dtype=F64)  # back to a scalar: same dtype
    assert gate._gamma.dtype == F64 and gate.gamma == 0.1
    gate.gamma = [0.1, 0.2, 0.3]
    assert gate._gamma.dtype == F64
    gate = gate.float()
    assert gate._gamma.dtype == torch.float32 and gate().weights.dtype == torch.float32
    # a fresh per-gate buffer takes the default dtype, like a fresh scalar one
    fresh = DSelectK(8, 2, num_gates=3, gamma=torch.tensor([1, 2, 3]))
    assert fresh._gamma.dtype == torch.get_default_dtype()


def test_per_gate_in_constructors_and_repr() -> None:
    gate = DSelectKExtended(8, 2, num_gates=3, gamma=(0.5, 1, 2), entropy_reg=[0, 0.1, 0.2])
    assert gate.gamma.tolist() == [0.5, 1.0, 2.0]
    assert "gamma=[0.5, 1, 2]" in repr(gate) and "entropy_reg=[0, 0.1, 0.2]" in repr(gate)
    assert "diversity" not in repr(gate)
    gate.diversity = 0.5
    assert "diversity=0.5" in repr(gate)
    big = DSelectK(8, 2, num_gates=10, gamma=torch.arange(1.0, 11.0))
    assert "gamma=[1, 2, 3, ..., 10] (10 gates)" in repr(big)
    sel = SoftmaxSelectorGate(8, 2, num_gates=2, temperature=[1.0, 0.5], entropy_reg=[0.0, 1.0])
    assert "temperature=[1, 0.5]" in repr(sel)
    gum = GumbelSoftmaxGate(8, num_gates=2, temperature=[1.0, 0.5], sparsity_reg=[0.1, 0.2])
    assert "temperature=[1, 0.5]" in repr(gum)
    assert gum.sparsity_reg.tolist() == pytest.approx([0.1, 0.2])


@pytest.mark.parametrize(
    ("factory", "error", "match"),
    [
        (
            lambda: DSelectK(8, 2, num_gates=8, gamma=[1.0, 2.0, 3.0]),
            ValueError,
            r"gamma must have one value per gate \(T=8\), got 3",
        ),
        (
            lambda: DSelectK(8, 2, num_gates=3, gamma=[1.0, 0.0, 2.0]),
            ValueError,
            r"gamma must be a finite number > 0 for every gate, got 0.0 \(gate 1\)",
        ),
        (
            lambda: DSelectK(8, 2, num_gates=2, gamma=[1.0, math.inf]),
            ValueError,
            "gamma must be a finite number > 0",
        ),
        (
            lambda: DSelectK(8, 2, num_gates=2, entropy_reg=torch.tensor([0.1, math.nan])),
            ValueError,
            "entropy_reg must be a finite number >= 0",
        ),
        (
            lambda: DSelectK(8, 2, num_gates=2, entropy_reg=[-0.1, 0.0]),
            ValueError,
            r"entropy_reg must be a finite number >= 0 for every gate, got -0.1 \(gate 0\)",
        ),
        (
            lambda: DSelectKExtended(8, 2, num_gates=2, diversity=[0.0, -1.0]),
            ValueError,
            "diversity must be a finite number >= 0",
        ),
        (lambda: DSelectKExtended(8, 2, diversity=-1.0), ValueError, "diversity"),
        (
            lambda: DSelectK(8, 2, gamma=[1.0, 2.0]),
            ValueError,
            "gamma has 2 values but DSelectK is a single gate",
        ),
        (
            lambda: DSelectK(8, 2, num_gates=2, gamma=torch.ones(2, 2)),
            ValueError,
            r"gamma must be a number or a 1-d tensor with one value per gate, got shape \(2, 2\)",
        ),
        (lambda: DSelectK(8, 2, num_gates=2, gamma=["a", "b"]), TypeError, "gamma"),
        (lambda: DSelectK(8, 2, gamma="1.0x"), TypeError, "gamma must be a number"),
        (
            lambda: SoftmaxSelectorGate(8, 2, num_gates=3, temperature=[1.0, 1.0]),
            ValueError,
            r"temperature must have one value per gate \(T=3\), got 2",
        ),
        (
            lambda: SoftmaxSelectorGate(8, 2, num_gates=2, temperature=[1.0, -1.0]),
            ValueError,
            "temperature must be a finite number > 0",
        ),
        (
            lambda: GumbelSoftmaxGate(8, num_gates=2, sparsity_reg=[1.0, -1.0]),
            ValueError,
            "sparsity_reg must be a finite number >= 0",
        ),
    ],
)
def test_per_gate_validation(factory: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        factory()


def test_failed_assignment_leaves_the_value() -> None:
    gate = DSelectK(8, 2, num_gates=2, gamma=[1.0, 2.0])
    with pytest.raises(ValueError, match="gamma"):
        gate.gamma = [1.0, -2.0]
    with pytest.raises(ValueError, match="gamma"):
        gate.gamma = 0.0
    with pytest.raises(ValueError, match="gamma"):
        gate.gamma = [1.0, 2.0, 3.0]
    assert gate.gamma.tolist() == [1.0, 2.0]


def test_hyperparameter_descriptor_introspection() -> None:
    gate = DSelectKExtended(8, 2, num_gates=2, gamma=[1.0, 2.0])
    hp = DSelectK.gamma
    assert isinstance(hp, HyperParameter) and hp.buffer_name == "_gamma"
    assert hp.is_per_gate(gate) and not DSelectK.entropy_reg.is_per_gate(gate)
    assert not DSelectKExtended.diversity.is_nonzero(gate)
    gate.diversity = [0.0, 0.1]
    assert DSelectKExtended.diversity.is_nonzero(gate)
    gate.diversity = 0.0
    assert not DSelectKExtended.diversity.is_nonzero(gate)


# -- state_dict, schedules, copies ----------------------------------------------------------------


@pytest.mark.parametrize("in_features", [None, P])
def test_state_dict_round_trip_with_per_gate_buffers(in_features: int | None) -> None:
    torch.manual_seed(0)
    kw: dict[str, Any] = {"in_features": in_features, "num_gates": 3}
    gate = DSelectKExtended(
        8, 2, gamma=[0.5, 1.0, 2.0], entropy_reg=[0.0, 0.1, 1.0], diversity=0.3, **kw
    )
    state = gate.state_dict()
    assert state["_gamma"].shape == (3,) and state["_diversity"].shape == ()
    clone = DSelectKExtended(8, 2, **kw)  # scalar hyperparameters: re-registered on load
    clone.load_state_dict(state)
    assert clone.gamma.tolist() == [0.5, 1.0, 2.0]
    assert clone.entropy_reg.tolist() == pytest.approx([0.0, 0.1, 1.0])
    assert clone.diversity == pytest.approx(0.3) and DSelectKExtended.diversity.is_nonzero(clone)
    x = None if in_features is None else torch.randn(B, P)
    _assert_equal(list(clone(x)), list(gate(x)))
    # and back: a scalar state into a per-gate module
    scalar = DSelectKExtended(8, 2, gamma=0.7, **kw)
    clone.load_state_dict(scalar.state_dict())
    assert clone.gamma == pytest.approx(0.7) and not DSelectKExtended.diversity.is_nonzero(clone)
    _assert_equal(list(clone(x)), list(scalar(x)))
    # a state saved before the diversity option existed still loads (strict)
    old = {k: v for k, v in gate.state_dict().items() if k != "_diversity"}
    fresh = DSelectKExtended(8, 2, **kw)
    fresh.load_state_dict(old)
    assert fresh.diversity == 0.0
    # a wrong number of gates is still an error
    with pytest.raises(RuntimeError, match="_gamma"):
        DSelectKExtended(8, 2, **kw).load_state_dict({**state, "_gamma": torch.ones(5)})
    sel = SoftmaxSelectorGate(8, 2, num_gates=3, temperature=[1.0, 0.5, 0.1])
    sel2 = SoftmaxSelectorGate(8, 2, num_gates=3)
    sel2.load_state_dict(sel.state_dict())
    _assert_equal(list(sel2()), list(sel()))


def test_state_dict_in_a_parent_module() -> None:
    parent = torch.nn.Sequential(DSelectK(8, 2, num_gates=2, gamma=[1.0, 2.0]))
    other = torch.nn.Sequential(DSelectK(8, 2, num_gates=2))
    other.load_state_dict(parent.state_dict())
    assert other[0].gamma.tolist() == [1.0, 2.0]


def test_attribute_scheduler_float_assignment() -> None:
    scalar = DSelectK(8, 2, gamma=4.0)
    bank = DSelectK(8, 2, num_gates=3, gamma=[4.0, 2.0, 1.0])
    scalar.gamma = 2.0  # what an AttributeScheduler does
    assert scalar.gamma == 2.0 and isinstance(scalar.gamma, float)
    sched = AttributeScheduler([scalar, bank], "gamma", GeometricSchedule(4.0, 0.25, 4))
    buf = bank._gamma
    for step in range(5):
        want = 4.0 * (0.25 / 4.0) ** (min(step, 4) / 4)
        assert scalar.gamma == pytest.approx(want)
        assert bank.gamma.tolist() == pytest.approx([want] * 3)  # broadcast, in place
        assert bank._gamma is buf
        sched.step()
    lam = AttributeScheduler(bank, "entropy_reg", LinearSchedule(0.0, 1.0, 2))
    lam.step()
    assert bank.entropy_reg == pytest.approx(0.5)


def test_per_member_schedule_writes_per_gate_values() -> None:
    """A schedule returning one value per gate (a (T,) tensor) writes them in place."""
    bank = SoftmaxSelectorGate(8, 2, num_gates=3, temperature=[1.0, 0.5, 2.0])
    buf = bank._temperature
    start = torch.tensor([1.0, 0.5, 2.0], dtype=F64)
    sched = AttributeScheduler(bank, "temperature", GeometricSchedule(start, 1e-16, 10))
    sched.step()
    assert bank._temperature is buf
    torch.testing.assert_close(bank.temperature, sched.value.float())


def test_deepcopy_keeps_per_gate_values() -> None:
    import copy

    gate = DSelectKExtended(8, 2, num_gates=2, gamma=[1.0, 2.0], diversity=[0.0, 1.0])
    dup = copy.deepcopy(gate)
    assert dup.gamma.tolist() == [1.0, 2.0] and DSelectKExtended.diversity.is_nonzero(dup)
    _assert_equal(list(dup()), list(gate()))


def test_per_gate_values_under_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float assignments to a per-gate hyperparameter do not recompile (written in place).
    (The NumPy kernel: compiled = eager bit for bit; numba's eager node is the compiled gate's
    numbers to float rounding, tests/test_numba_kernel.py.)"""
    monkeypatch.setenv("DSELECTK_KERNEL", "numpy")
    torch._dynamo.reset()
    gate = DSelectK(8, 2, num_gates=3, gamma=[1.0, 2.0, 0.5], entropy_reg=[0.1, 0.0, 1.0])
    compiled = torch.compile(gate, backend="eager", fullgraph=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for value in (1.0, 0.7, 0.3):
            gate.gamma = value
            _assert_equal(list(compiled()), list(gate()))


# -- selector diversity ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("layout", [(None, None), (None, T), (P, None), (P, T)])
@pytest.mark.parametrize("mu", [0.0, 0.3, 2.0])
def test_diversity_bitwise_equals_diverse_dselect_k(
    dispatch: str, dtype: torch.dtype, layout: tuple[Any, Any], mu: float
) -> None:
    in_features, num_gates = layout
    kw: dict[str, Any] = {"in_features": in_features, "num_gates": num_gates, "gamma": 1.5}
    kw["entropy_reg"] = 0.2
    torch.manual_seed(0)
    lib = DSelectKExtended(16, 3, diversity=mu, **kw).to(dtype)
    lib.diversity = mu  # exact in float64 too (the reference holds a Python float)
    torch.manual_seed(0)
    ref = RefDiverseDSelectK(16, 3, diversity=mu, **kw).to(dtype)
    _spread(lib, 5.0)
    ref.load_state_dict({k: v for k, v in lib.state_dict().items() if k != "_diversity"})
    x = None if in_features is None else torch.randn(B, P, dtype=dtype)
    logits = lib.compute_logits(x)
    _assert_equal(_outputs_and_grads(lib, logits), _outputs_and_grads(ref, logits))


def _expanded_diversity(p: torch.Tensor, mu: float) -> torch.Tensor:
    """μ Σ_{i<j} Σ_c r_i(c) r_j(c), with r_i(c) = Π_m (p_im if bit m of c else 1 - p_im)."""
    k, m = p.shape
    laws = []
    for i in range(k):
        law = []
        for code in range(2**m):
            prob = torch.ones((), dtype=p.dtype)
            for b in range(m):
                prob = prob * (p[i, b] if (code >> b) & 1 else 1 - p[i, b])
            law.append(prob)
        laws.append(torch.stack(law))
    total = torch.zeros((), dtype=p.dtype)
    for i, j in itertools.combinations(range(k), 2):
        total = total + (laws[i] * laws[j]).sum()
    return mu * total


@given(
    m=st.integers(1, 4),
    k=st.integers(1, 4),
    mu=st.floats(0.01, 5.0),
    gamma=st.floats(0.1, 4.0),
    data=st.data(),
)
def test_diversity_equals_expanded_code_laws(
    m: int, k: int, mu: float, gamma: float, data: st.DataObject
) -> None:
    n = 2**m
    k = min(k, n)
    gate = DSelectKExtended(n, k, gamma=gamma, diversity=mu).double()
    gate.gamma, gate.diversity = gamma, mu
    z = data.draw(
        st.lists(st.floats(-3.0, 3.0), min_size=k * m, max_size=k * m).map(
            lambda v: torch.tensor(v, dtype=F64).view(k, m)
        )
    )
    with torch.no_grad():
        gate.logits[k:] = z.flatten()
    p = DF.smooth_step(z, gamma)
    want = _expanded_diversity(p, mu)
    torch.testing.assert_close(gate.diversity_penalty(gate.z), want, rtol=1e-12, atol=1e-12)
    base = DSelectK(n, k, gamma=gamma).double()
    base.gamma = gamma
    base.load_state_dict({k_: v for k_, v in gate.state_dict().items() if k_ != "_diversity"})
    torch.testing.assert_close(gate().aux_loss - base().aux_loss, want, rtol=1e-12, atol=1e-12)


def test_diversity_bank_per_gate_and_per_example() -> None:
    torch.manual_seed(0)
    mus = [0.0, 1.0, 0.5]
    bank = DSelectKExtended(8, 3, in_features=P, num_gates=3, gamma=[1.0, 2.0, 0.5]).double()
    bank.gamma, bank.diversity = [1.0, 2.0, 0.5], mus
    _spread(bank, 10.0)
    x = torch.randn(B, P, dtype=F64)
    _, z = bank.split_logits(bank.compute_logits(x))  # (B, 3, K, M)
    got = bank.diversity_penalty(z)
    assert got.shape == (B, 3)
    for b_, t in itertools.product(range(B), range(3)):
        p = DF.smooth_step(z[b_, t], [1.0, 2.0, 0.5][t])
        torch.testing.assert_close(got[b_, t], _expanded_diversity(p, mus[t]))
    base = DSelectK(8, 3, in_features=P, num_gates=3).double()
    base.gamma = [1.0, 2.0, 0.5]
    base.load_state_dict({k: v for k, v in bank.state_dict().items() if k != "_diversity"})
    torch.testing.assert_close(bank(x).aux_loss - base(x).aux_loss, got.sum() / B)


def test_diversity_gradient_vanishes_once_binary_and_separates_selectors() -> None:
    gate = DSelectKExtended(8, 2, gamma=1.0, diversity=1.0).double()
    with torch.no_grad():
        gate.logits[2:] = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, -1.0], dtype=F64)
    assert gate().aux_loss.item() == 0.0  # codes 7 and 3: distinct
    with torch.no_grad():
        gate.logits[2:] = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=F64)
    out = gate()
    assert out.aux_loss.item() == 1.0  # the same code
    out.aux_loss.backward()
    assert gate.logits.grad is not None and gate.logits.grad.abs().max().item() == 0.0
    with torch.no_grad():
        gate.logits[2:] = 0.1  # fractional and equal: the penalty pushes the selectors apart
    gate.logits.grad = None
    gate().aux_loss.backward()
    assert gate.logits.grad is not None and gate.logits.grad.abs().sum() > 0


# -- every registered gate with per-gate values ----------------------------------------------------


@pytest.mark.parametrize("name", ["dselect_k", "ablation_entropy", "gumbel_softmax"])
@pytest.mark.parametrize("in_features", [None, P])
def test_registered_gates_accept_per_gate_values(name: str, in_features: int | None) -> None:
    import dselectk as dk
    from dselectk.gates.base import hyperparameters

    torch.manual_seed(0)
    kw: dict[str, Any] = {} if name == "gumbel_softmax" else {"k": 2}
    gate = dk.make_gate(name, 8, in_features=in_features, num_gates=3, **kw).double()
    hps = hyperparameters(gate)
    assert hps
    for i, (key, hp) in enumerate(hps.items()):
        low = 0.5 if hp.positive else 0.0
        setattr(gate, key, [low + 0.25 * i, low + 1.0, low + 0.5])
        assert hp.is_per_gate(gate)
    x = None if in_features is None else torch.randn(B, P, dtype=F64)
    out = gate(x)
    assert out.weights.shape == (*(() if x is None else (B,)), 3, 8)
    assert out.aux_loss.dim() == 0 and torch.isfinite(out.aux_loss)
    if gate.on_simplex:
        torch.testing.assert_close(
            out.weights.sum(-1), torch.ones(out.weights.shape[:-1], dtype=F64)
        )
    (out.weights * torch.randn_like(out.weights)).sum().add(out.aux_loss).backward()
    for pname, p in gate.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    gate.eval()
    clone = dk.make_gate(name, 8, in_features=in_features, num_gates=3, **kw).double().eval()
    clone.load_state_dict(gate.state_dict())
    _assert_equal(list(clone(x)), list(gate(x)))
    for key in hps:
        torch.testing.assert_close(getattr(clone, key), getattr(gate, key), rtol=0, atol=0)


def test_assigned_tensor_is_never_aliased() -> None:
    """The buffer is a copy of the assigned tensor, also when no dtype conversion is needed."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        src = torch.tensor([0.5, 1.0, 2.0], dtype=F64)
        gate = DSelectK(8, 2, num_gates=3, gamma=src)
        gate.gamma = 3.0
        assert src.tolist() == [0.5, 1.0, 2.0] and gate.gamma.tolist() == [3.0] * 3
    finally:
        torch.set_default_dtype(default)
