"""Bad inputs that a check would otherwise accept without checking anything: tolerances, search
arguments, loaded states, constructor numbers. Each is refused with an error naming the argument
and what was expected, or gives a correct result."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

from dselectk import DSelectK, MultiGateMoE, StackedMLP
from dselectk.export import ExportVerificationError, export_program, to_onnx, verify
from dselectk.gates import TopKGate
from dselectk.search import SwapSearch, swap_search

NAN, INF = float("nan"), float("inf")


def _model() -> MultiGateMoE:
    torch.manual_seed(0)
    gate = DSelectK(8, 2, in_features=6, num_gates=2)
    towers = StackedMLP(2, 5, [4, 1], final_activation=False)
    return MultiGateMoE(StackedMLP(8, 6, [5]), gate, towers, conditional=True).eval()


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
