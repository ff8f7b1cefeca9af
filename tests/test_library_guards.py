"""Bad inputs that a check would otherwise accept without checking anything: tolerances, search
arguments, loaded states, constructor numbers. Each is refused with an error naming the argument
and what was expected, or gives a correct result."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

from dselectk import DSelectK, MultiGateMoE
from dselectk.export import ExportVerificationError, export_program, to_onnx, verify
from dselectk.gates import TopKGate
from dselectk.layers import StackedMLP
from dselectk.search import SwapSearch, swap_search

NAN, INF = float("nan"), float("inf")


def _model() -> MultiGateMoE:
    torch.manual_seed(0)
    gate = DSelectK(8, 2, in_features=6, num_gates=2)
    towers = StackedMLP(2, 5, [4, 1], final_activation=False)
    return MultiGateMoE(
        StackedMLP(8, 6, [5], final_activation=True), gate, towers, conditional=True
    ).eval()


def _wrong(model: MultiGateMoE):  # a deliberately wrong "exported graph"
    def run(xs: list[Tensor]) -> list[Tensor]:
        return [o + 1.0 for o in model(*xs).outputs]

    return run


# -- export verification ----------------------------------------------------------------------
def test_a_wrong_graph_fails_verification_at_sane_tolerances() -> None:
    model = _model()
    with pytest.raises(ExportVerificationError):
        verify(_wrong(model), model, torch.randn(16, 6))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"atol": NAN}, "atol must be a finite number >= 0"),
        ({"rtol": NAN}, "rtol must be a finite number >= 0"),
        ({"atol": INF}, "atol must be a finite number >= 0"),
        ({"rtol": -1.0}, "rtol must be a finite number >= 0"),
        ({"atol": -1e-5}, "atol must be a finite number >= 0"),
        ({"batch_sizes": []}, "batch_sizes must be a non-empty"),
        ({"batch_sizes": [0]}, r"batch_sizes must hold ints >= 1"),
        ({"batch_sizes": [4, -2]}, r"batch_sizes must hold ints >= 1"),
    ],
)
def test_verification_that_would_check_nothing_is_refused(
    kwargs: dict[str, object], match: str
) -> None:
    model = _model()
    with pytest.raises(ValueError, match=match):
        verify(_wrong(model), model, torch.randn(16, 6), **kwargs)
    with pytest.raises(ValueError, match=match):  # before any export work
        export_program(model, torch.randn(16, 6), **kwargs)


def test_verification_argument_types_are_checked(tmp_path: Path) -> None:
    model = _model()
    with pytest.raises(TypeError, match="atol"):
        verify(_wrong(model), model, torch.randn(16, 6), atol="1e-5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="batch_sizes"):
        verify(_wrong(model), model, torch.randn(16, 6), batch_sizes=[2.5])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="batch_sizes"):
        verify(_wrong(model), model, torch.randn(16, 6), batch_sizes=4)  # type: ignore[arg-type]
    path = tmp_path / "m.onnx"
    with pytest.raises(ValueError, match="rtol"):  # refused before onnx is even needed
        to_onnx(model, torch.randn(16, 6), path, rtol=NAN)
    assert not path.exists()


# -- swap search ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tol": NAN}, ValueError, "tol must be a finite number >= 0"),
        ({"tol": INF}, ValueError, "tol must be a finite number >= 0"),
        ({"tol": -0.1}, ValueError, "tol must be a finite number >= 0"),
        ({"scale": INF}, ValueError, "scale must be a finite number >= 0.5"),
        ({"scale": NAN}, ValueError, "scale must be a finite number >= 0.5"),
        ({"sweeps": 1.5}, TypeError, "sweeps must be an int"),
        ({"sweeps": 0}, ValueError, "sweeps must be >= 1"),
        ({"tol": "0.1"}, TypeError, "tol must be a finite number"),
    ],
)
def test_swap_search_and_its_callback_refuse_bad_arguments_at_once(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    gate = DSelectK(8, 2, num_gates=3)
    before = gate.z.detach().clone()
    with pytest.raises(error, match=match):
        swap_search(gate, lambda: torch.zeros(3), **kwargs)
    with pytest.raises(error, match=match):  # at construction, not when training reaches step 5
        SwapSearch(gate, lambda: torch.zeros(3), at=[5], **kwargs)
    assert torch.equal(gate.z, before) and torch.isfinite(gate.z).all()


def test_swap_search_callback_checks_its_steps_and_loss() -> None:
    gate = TopKGate(8, 2)
    with pytest.raises(TypeError, match="member_loss must be callable"):
        SwapSearch(gate, torch.zeros(1), at=[5])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"at: steps must be ints >= 1, got 2.5"):
        SwapSearch(gate, lambda: torch.zeros(1), at=[2.5])
    with pytest.raises(TypeError, match="binarize_at"):
        SwapSearch(gate, lambda: torch.zeros(1), at=[1], binarize_at=[True])
    with pytest.raises(TypeError, match="at must be a sequence"):
        SwapSearch(gate, lambda: torch.zeros(1), at=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one step"):
        SwapSearch(gate, lambda: torch.zeros(1), at=[])
    with pytest.raises(ValueError, match="fractions must lie in"):
        SwapSearch.at_fractions(gate, lambda: torch.zeros(1), 100, (NAN,))
    assert math.isfinite(SwapSearch(gate, lambda: torch.zeros(1), at=[3]).tol)


# -- state loaded through the setters' checks ---------------------------------------------------
@pytest.mark.parametrize("bad", [-3.0, NAN, INF, 0.0])
def test_a_state_with_a_gamma_the_setter_refuses_does_not_load(bad: float) -> None:
    gate = DSelectK(6, 2)
    with pytest.raises(ValueError, match="gamma must be a finite number > 0"):
        gate.gamma = bad
    state = DSelectK(6, 2).state_dict()
    state["_gamma"] = torch.tensor(bad)
    before = {k: v.clone() for k, v in gate.state_dict().items()}
    with pytest.raises(ValueError, match=r"_gamma: gamma must be a finite number > 0"):
        gate.load_state_dict(state)
    for key, value in gate.state_dict().items():  # nothing was loaded
        assert torch.equal(value, before[key]), key


def test_a_per_gate_state_with_one_negative_value_does_not_load() -> None:
    gate = DSelectK(6, 2, num_gates=3)
    state = gate.state_dict()
    state["_entropy_reg"] = torch.tensor([0.1, -0.1, 0.0])
    with pytest.raises(ValueError, match="entropy_reg must be a finite number >= 0"):
        gate.load_state_dict(state)


def test_a_state_of_another_meaning_with_the_same_shapes_does_not_load(tmp_path: Path) -> None:
    five, six = DSelectK(5, 2), DSelectK(6, 2)
    assert {k: v.shape for k, v in five.state_dict().items()} == {
        k: v.shape for k, v in six.state_dict().items()
    }  # same shapes: only the meaning differs
    with pytest.raises(ValueError, match=r"num_experts=5, k=2; this gate has num_experts=6, k=2"):
        six.load_state_dict(five.state_dict())
    with pytest.raises(ValueError, match=r"TopKGate with num_experts=6, k=2; .* k=3"):
        TopKGate(6, 3).load_state_dict(TopKGate(6, 2).state_dict())
    path = tmp_path / "gate.pt"  # the meaning survives torch.save / torch.load
    torch.save(five.state_dict(), path)
    with pytest.raises(ValueError, match="num_experts=5"):
        six.load_state_dict(torch.load(path, weights_only=True))
    other = DSelectK(5, 2)
    other.load_state_dict(torch.load(path, weights_only=True))
    torch.testing.assert_close(other().weights, five().weights, rtol=0, atol=0)


def test_a_state_saved_without_the_meaning_still_loads() -> None:
    five, six = DSelectK(5, 2), DSelectK(6, 2)
    old = {k: v for k, v in five.state_dict().items() if not k.endswith("_extra_state")}
    assert six.load_state_dict(old, strict=True).missing_keys == []  # no check: skipped
    nested = MultiGateMoE(
        StackedMLP(8, 6, [5], final_activation=True), DSelectK(8, 2, num_gates=2), None
    )
    state = {k: v for k, v in nested.state_dict().items() if not k.endswith("_extra_state")}
    assert nested.load_state_dict(state, strict=True).missing_keys == []


# -- smaller ones -------------------------------------------------------------------------------
def test_balance_loss_of_an_empty_batch_is_zero_with_gradients() -> None:
    from dselectk.layers.token_moe import balance_loss

    weights = torch.zeros(0, 4, requires_grad=True)
    loss = balance_loss(weights, torch.zeros(4, dtype=torch.long))
    assert loss.item() == 0.0
    loss.backward()
    assert weights.grad is not None and weights.grad.shape == (0, 4)
    full = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # unchanged on a non-empty batch: n Σ f P
    assert balance_loss(full, torch.tensor([1, 1])).item() == pytest.approx(1.0)


def test_demo_seed_out_of_range_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    from dselectk.cli import main

    for seed in ("99999999999999999999", "1e20", "-1"):
        with pytest.raises(SystemExit) as e:
            main(["demo", "--seed", seed])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --seed: expected an integer" in err and "Traceback" not in err


def test_demo_with_one_group_says_there_is_no_cross_group_pair(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dselectk.cli import main

    args = ["demo", "--tasks", "2", "--examples", "200", "--epochs", "1", "--restarts", "1"]
    assert main([*args, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "no cross-group pair (one group)" in out and "nan" not in out


def test_replace_routers_refuses_bad_weights_and_non_bool_renormalize() -> None:
    transformers = pytest.importorskip("transformers")
    from dselectk.integrations import hf

    cfg = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(cfg)
    for bad, error in ((NAN, ValueError), (-0.5, ValueError), (INF, ValueError), ("1", TypeError)):
        with pytest.raises(error, match="aux_loss_weight must be a finite number >= 0"):
            hf.replace_routers(model, "dselect_k", aux_loss_weight=bad)
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match="renormalize must be True or False"):
            hf.replace_routers(model, "dselect_k", renormalize=bad)
    assert not hf.find_moe_blocks(model) or all(
        not isinstance(getattr(b, "gate", None), hf.GateRouter)
        for _, b in hf.find_moe_blocks(model)
    )  # nothing was replaced
    assert len(hf.replace_routers(model, "dselect_k", aux_loss_weight=0, renormalize=True)) == 1


# -- γ below the bound where the optimizer's statistics overflow -----------------------------------
def test_gamma_below_the_documented_bound_is_refused_everywhere() -> None:
    from dselectk.gates import make_gate
    from dselectk.gates.hyperparameter import GAMMA_MIN

    for build in (
        lambda: DSelectK(8, 2, gamma=1e-20),
        lambda: DSelectK(8, 2, gamma=[1.0, GAMMA_MIN / 10], num_gates=2),
        lambda: make_gate("comet", 8, k=2, gamma=1e-19),
    ):
        with pytest.raises(ValueError, match=r"gamma must be >= 1e-10, got 1e-"):
            build()
    gate = DSelectK(8, 2, gamma=GAMMA_MIN)  # the bound itself is allowed
    with pytest.raises(ValueError, match="gamma must be >= 1e-10"):
        gate.gamma = 1e-19
    state = gate.state_dict()
    state["_gamma"] = torch.tensor(1e-19, dtype=torch.float64)
    with pytest.raises(ValueError, match="gamma must be >= 1e-10"):
        DSelectK(8, 2).load_state_dict(state)


def test_adam_statistics_overflow_below_the_bound_not_at_it() -> None:
    """The measurement behind GAMMA_MIN: Adam's second moment of the selectors' gradient grows
    as 1/γ² and reaches float32's inf near γ = 1e-22 for this unit-scale loss."""
    from dselectk.gates.hyperparameter import GAMMA_MIN

    def second_moment(gamma: float) -> float:
        torch.manual_seed(0)
        gate = DSelectK(8, 2)  # γ = 1: logits from U(-1/100, 1/100)
        with torch.no_grad():  # as built with this γ (U(-γ/100, γ/100)), past the setter
            gate.logits.mul_(gamma)
            gate._gamma.fill_(gamma)
        opt = torch.optim.Adam(gate.parameters(), lr=1e-3)
        target = torch.zeros(8)
        target[3] = 1.0
        for _ in range(20):
            loss = ((gate().weights - target) ** 2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return max(float(s["exp_avg_sq"].max()) for s in opt.state.values())

    assert second_moment(1e-23) == INF
    assert second_moment(GAMMA_MIN) < 1e20
