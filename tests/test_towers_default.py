"""Task towers that end in ReLU only because StackedMLP defaults to it are warned about: such a
tower predicts nothing below 0, so negative targets stall with no error."""

from __future__ import annotations

import warnings

import pytest
import torch

from dselectk.gates import DSelectK
from dselectk.layers import StackedMLP, make_towers
from dselectk.models import MultiGateMoE, SharedBottom


def test_defaulted_relu_towers_warn_and_cannot_go_negative() -> None:
    with pytest.warns(UserWarning, match="towers: this StackedMLP ends in relu"):
        model = MultiGateMoE(
            StackedMLP(4, 3, [8]), DSelectK(4, 2, num_gates=2), StackedMLP(2, 8, [1])
        )
    out = model(torch.randn(64, 3)).outputs
    assert all(float(o.min()) >= 0.0 for o in out)  # why it warns
    with pytest.warns(UserWarning, match="towers: this StackedMLP ends in relu"):
        SharedBottom(StackedMLP(1, 3, [8]), StackedMLP(2, 8, [1]))


def test_explicit_or_linear_towers_and_experts_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        experts = StackedMLP(4, 3, [8])  # experts keep the paper's final ReLU by default
        assert experts.final_activation
        MultiGateMoE(experts, DSelectK(4, 2, num_gates=2), make_towers(2, 8, [1]))
        MultiGateMoE(StackedMLP(4, 3, [8]), DSelectK(4, 2, num_gates=2),
                     StackedMLP(2, 8, [1], final_activation=True))  # fmt: skip
        MultiGateMoE(StackedMLP(4, 3, [8]), DSelectK(4, 2, num_gates=2),
                     StackedMLP(2, 8, [1], activation="identity"))  # fmt: skip
        SharedBottom(StackedMLP(1, 3, [8]), StackedMLP(2, 8, [4, 1], final_activation=False))
