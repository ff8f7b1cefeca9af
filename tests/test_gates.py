"""Contract test over every registered gate, plus gate-specific behaviour and input errors."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch.autograd import gradcheck

import dselectk as dk
from dselectk.gates import (
    DSelectK,
    DSelectKExtended,
    Gate,
    GateOutput,
    GumbelSoftmaxGate,
    SoftmaxSelectorGate,
    TopKGate,
    gate_names,
)

N, P, B = 8, 5, 6


def kwargs_for(name: str) -> dict[str, Any]:
    return {} if name in ("softmax", "gumbel_softmax") else {"k": 2}


LAYOUTS = [(None, None), (None, 3), (P, None), (P, 3)]  # (in_features, num_gates)


def build(name: str, in_features: int | None, num_gates: int | None, **kw: Any) -> Gate:
    torch.manual_seed(0)
    return dk.make_gate(
        name, N, in_features=in_features, num_gates=num_gates, **kwargs_for(name), **kw
    )


def expected_shape(in_features: int | None, num_gates: int | None, batch: int) -> tuple[int, ...]:
    lead = () if in_features is None else (batch,)
    return (*lead, *(() if num_gates is None else (num_gates,)), N)


@pytest.mark.parametrize("name", gate_names())
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [1, B])
def test_gate_contract(name: str, layout: tuple[Any, Any], dtype: torch.dtype, batch: int) -> None:
    in_features, num_gates = layout
    gate = build(name, in_features, num_gates).to(dtype)
    x = None if in_features is None else torch.randn(batch, P, dtype=dtype)
    out = gate(x)
    assert isinstance(out, GateOutput)
    w = out.weights
    assert w.shape == expected_shape(in_features, num_gates, batch)
    assert w.dtype == dtype and out.aux_loss.dtype == dtype and out.aux_loss.dim() == 0
    assert torch.isfinite(w).all() and torch.isfinite(out.aux_loss)
    assert (w >= 0).all()
    if gate.on_simplex:
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1], dtype=dtype))
    else:
        assert (w.sum(-1) <= 1 + 1e-6).all()
    if isinstance(gate, TopKGate):
        assert ((w > 0).sum(-1) <= gate.k).all()

    # gradients reach every parameter
    (w * torch.randn_like(w)).sum().add(out.aux_loss).backward()
    for pname, p in gate.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname

    # deterministic in eval
    gate.eval()
    torch.testing.assert_close(gate(x).weights, gate(x).weights, rtol=0, atol=0)

    # state_dict round trip
    clone = build(name, in_features, num_gates).to(dtype)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(1.0)
    clone.load_state_dict(gate.state_dict())
    clone.eval()
    torch.testing.assert_close(clone(x).weights, gate(x).weights, rtol=0, atol=0)


@pytest.mark.parametrize("name", gate_names())
def test_buffers_follow_to(name: str) -> None:
    gate = build(name, None, None).to(torch.float64)
    for buf in gate.buffers():
        if buf.is_floating_point():
            assert buf.dtype == torch.float64
    assert gate().weights.dtype == torch.float64


@pytest.mark.parametrize("name", gate_names())
@pytest.mark.parametrize("layout", [(None, 2), (P, None)])
def test_gate_gradcheck(name: str, layout: tuple[Any, Any]) -> None:
    in_features, num_gates = layout
    gate = build(name, in_features, num_gates).double().eval()
    if isinstance(gate, DSelectK):
        gate.entropy_reg = 0.3
    if isinstance(gate, SoftmaxSelectorGate):
        gate.entropy_reg = 0.3
    if isinstance(gate, GumbelSoftmaxGate):
        gate.sparsity_reg = 0.3
    x = None if in_features is None else torch.randn(3, P, dtype=torch.float64)
    logits = gate.compute_logits(x).detach().requires_grad_()

    def fn(lg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = gate.gate(lg)
        return out.weights, out.aux_loss

    assert gradcheck(fn, (logits,), atol=1e-6)


# -- DSelect-k specifics ---------------------------------------------------------------------


def test_dselect_k_parameter_count_is_k_plus_k_log_n() -> None:
    for n, k in [(8, 2), (128, 4), (1000, 3)]:
        gate = DSelectK(n, k)
        m = math.ceil(math.log2(n))
        assert sum(p.numel() for p in gate.parameters()) == k + k * m


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dselect_k_initial_bits_strictly_fractional(layout: tuple[Any, Any]) -> None:
    in_features, num_gates = layout
    for init in ("paper", "spread"):
        gate = DSelectKExtended(
            16, 4, in_features=in_features, num_gates=num_gates, gamma=5.0, init=init
        )
        x = None if in_features is None else torch.randn(64, P)
        s = gate.bits(x)
        assert ((s > 0) & (s < 1)).all()


def test_dselect_k_static_matches_functional() -> None:
    gate = DSelectK(6, 3, gamma=2.0, num_gates=2)
    expected = dk.functional.dselect_k_weights(gate.alpha, gate.z, 2.0, 6)
    torch.testing.assert_close(gate().weights, expected)


def test_dselect_k_per_example_matches_formula() -> None:
    gate = DSelectK(8, 3, in_features=P, gamma=0.5, bias=False)
    x = torch.randn(4, P)
    w = gate.proj.weight  # rows: α (3), then Z (3 x 3)
    alpha = x @ w[:3].T
    z = (x @ w[3:].T).view(4, 3, 3)
    expected = dk.functional.dselect_k_weights(alpha, z, 0.5)
    torch.testing.assert_close(gate(x).weights, expected)


def test_dselect_k_entropy_term_value_and_batch_independence() -> None:
    gate = DSelectK(8, 2, in_features=P, entropy_reg=0.7)
    x = torch.randn(10, P)
    s = gate.bits(x)
    per_example = dk.functional.entropy(dk.functional.selector(s)).sum(-1)  # (B,)
    torch.testing.assert_close(gate(x).aux_loss, 0.7 * per_example.mean())
    # duplicating the batch leaves the (averaged) term unchanged
    torch.testing.assert_close(gate(torch.cat([x, x])).aux_loss, gate(x).aux_loss)
    static = DSelectK(8, 2, entropy_reg=0.7, num_gates=3)
    ent = dk.functional.entropy(dk.functional.selector(static.bits())).sum()
    torch.testing.assert_close(static().aux_loss, 0.7 * ent)


def test_dselect_k_non_power_of_two_penalty_in_aux_loss() -> None:
    gate = DSelectK(5, 2, xi=0.4, entropy_reg=0.0)
    p = gate.bits()
    expected = 0.4 / dk.functional.selector(p, 5).sum(-1)
    torch.testing.assert_close(gate().aux_loss, expected.sum())
    assert gate().weights.shape == (5,)
    assert DSelectK(8, 2, xi=0.4)().aux_loss.item() == 0.0


def test_dselect_k_introspection_binary() -> None:
    gate = DSelectK(8, 2, gamma=1.0, num_gates=2)
    assert not gate.is_binary().any()
    with torch.no_grad():
        gate.logits[0, 2:] = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0])  # codes 5, 4
    assert gate.is_binary().tolist() == [True, False]
    assert gate.selected_experts()[0].nonzero().flatten().tolist() == [4, 5]
    assert gate.num_selected()[0].item() == 2
    assert 0.5 <= gate.binary_fraction() < 1.0
    pe = DSelectK(8, 2, in_features=P, gamma=1.0)
    with torch.no_grad():
        pe.proj.weight.zero_()
        pe.proj.bias[2:] = 3.0
    x = torch.randn(7, P)
    assert pe.is_binary(x).item() == 1.0
    assert (pe.num_selected(x) == 1).all()  # both selectors on code 7


def test_dselect_k_gamma_and_lambda_are_settable_buffers() -> None:
    gate = DSelectK(8, 2, gamma=4.0)
    gate.gamma = 0.5
    gate.entropy_reg = 0.2
    assert gate.state_dict()["_gamma"].item() == 0.5
    assert gate.state_dict()["_entropy_reg"].item() == pytest.approx(0.2)
    with pytest.raises(ValueError, match="gamma"):
        gate.gamma = 0.0
    with pytest.raises(ValueError, match="entropy_reg"):
        gate.entropy_reg = -1.0


def test_gamma_reaches_the_smooth_step() -> None:
    gate = DSelectK(4, 1)
    with torch.no_grad():
        gate.logits[1:] = 0.4
    gate.gamma = 1.0  # 0.4 < 0.5: fractional
    assert not gate.is_binary()
    gate.gamma = 0.5  # 0.4 > 0.25: binary
    assert gate.is_binary()


# -- other gates -------------------------------------------------------------------------------


def test_topk_per_example_equals_definition() -> None:
    gate = TopKGate(N, 3, in_features=P)
    x = torch.randn(9, P)
    logits = gate.proj(x)
    expected = torch.softmax(dk.functional.keep_topk(logits, 3), -1)
    torch.testing.assert_close(gate(x).weights, expected)


def test_topk_noisy_and_balancing() -> None:
    torch.manual_seed(0)
    gate = TopKGate(N, 2, in_features=P, noisy=True, balance_weight=0.1)
    x = torch.randn(32, P)
    out = gate(x)
    assert out.aux_loss > 0 and ((out.weights > 0).sum(-1) == 2).all()
    out.weights.sum().add(out.aux_loss).backward()
    assert gate.noise_proj is not None and gate.noise_proj.weight.grad is not None
    gate.eval()
    torch.testing.assert_close(gate(x).weights, gate(x).weights)
    with pytest.raises(ValueError, match="per-example"):
        TopKGate(N, 2, noisy=True)


def test_gumbel_gate_penalty_and_expected_nonzeros() -> None:
    gate = GumbelSoftmaxGate(N, sparsity_reg=0.5, num_gates=2)
    keep = gate.logits[..., N:]
    expected = 0.5 * torch.nn.functional.logsigmoid(keep).sum()
    torch.testing.assert_close(gate().aux_loss, expected)
    torch.testing.assert_close(gate.expected_nonzeros(), torch.sigmoid(keep).sum(-1).detach())
    gate.eval()
    with torch.no_grad():
        gate.logits[0, N:] = torch.tensor([3.0, -3, -3, 3, -3, -3, -3, -3])
    w = gate().weights[0]
    assert (w > 0).nonzero().flatten().tolist() == [0, 3]


def test_ablation_gate_formula_and_annealing_limit() -> None:
    gate = SoftmaxSelectorGate(N, 2, entropy_reg=0.3)
    a = torch.softmax(gate.logits[:2], -1)
    beta = gate.logits[2:].view(2, N)
    expected = (a.unsqueeze(-1) * torch.softmax(beta, -1)).sum(0)
    torch.testing.assert_close(gate().weights, expected)
    ent = dk.functional.entropy(torch.softmax(beta, -1)).sum()
    torch.testing.assert_close(gate().aux_loss, 0.3 * ent)
    gate.temperature = 1e-16  # the end of the paper's anneal: each selector is one-hot
    w = gate().weights
    assert int((w > 0).sum()) <= 2
    torch.testing.assert_close(w, gate.hard_weights())


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: DSelectK(8, 0), "k must be >= 1"),
        (lambda: DSelectK(8, 9), "k must be <= num_experts"),
        (lambda: DSelectK(1, 1), "num_experts must be >= 2"),
        (lambda: DSelectK(8, 2, gamma=0.0), "gamma"),
        (lambda: DSelectK(8, 2, gamma=-1.0), "gamma"),
        (lambda: DSelectK(8, 2, entropy_reg=-0.1), "entropy_reg"),
        (lambda: DSelectK(8, 2, xi=-1.0), "xi"),
        (lambda: DSelectKExtended(8, 2, init="zeros"), "init"),
        (lambda: DSelectK(8, 2, in_features=0), "in_features"),
        (lambda: DSelectK(8, 2, num_gates=0), "num_gates"),
        (lambda: TopKGate(4, 5), "k must be <= num_experts"),
        (lambda: TopKGate(4, 2, balance_weight=-1.0), "balance_weight"),
        (lambda: SoftmaxSelectorGate(4, 2, temperature=0.0), "temperature"),
        (lambda: GumbelSoftmaxGate(4, sparsity_reg=-1.0), "sparsity_reg"),
        (lambda: dk.make_gate("nope", 4), "unknown gate"),
    ],
)
def test_bad_arguments_raise_value_error(factory: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        factory()


def test_bad_types_raise_type_error() -> None:
    with pytest.raises(TypeError, match="k must be an int"):
        DSelectK(8, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_experts"):
        DSelectK("8", 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        DSelectK(8, 2, in_features=P)([[0.0] * P])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", gate_names())
def test_bad_inputs(name: str) -> None:
    gate = build(name, P, None)
    with pytest.raises(ValueError, match=r"shape \(batch, 5\)"):
        gate(torch.randn(3, P + 1))
    with pytest.raises(ValueError, match=r"shape \(batch, 5\)"):
        gate(torch.randn(P))
    with pytest.raises(ValueError, match="needs an input"):
        gate(None)


@pytest.mark.parametrize("name", gate_names())
def test_removed_check_finite_keyword_says_what_to_use(name: str) -> None:
    # the debug switch is gone from every gate; train() names NaN/inf inputs of a batch itself
    # (tests/test_training_guards.py)
    with pytest.raises(TypeError, match=r"no argument 'check_finite'.*torch\.isfinite.*nonfinite"):
        build(name, P, None, check_finite=True)
    with pytest.raises(TypeError, match="check_finite"):
        dk.DSelectK(N, 2, check_finite=False)


def test_static_gate_ignores_no_input_and_deepcopies() -> None:
    gate = DSelectK(8, 2)
    torch.testing.assert_close(gate().weights, copy.deepcopy(gate)().weights)
