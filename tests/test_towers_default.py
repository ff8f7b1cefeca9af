"""StackedMLP's last layer is linear by default, so task towers predict values of any sign; the
ReLU after the last layer (the paper's experts) is asked for with ``final_activation=True``."""

from __future__ import annotations

import warnings

import torch

from dselectk.gates import DSelectK
from dselectk.layers import StackedMLP, make_towers
from dselectk.models import MultiGateMoE, SharedBottom


def test_default_towers_are_linear_and_can_go_negative() -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        towers = StackedMLP(2, 8, [1])
        assert not towers.final_activation
        model = MultiGateMoE(
            StackedMLP(4, 3, [8], final_activation=True), DSelectK(4, 2, num_gates=2), towers
        )
        SharedBottom(StackedMLP(1, 3, [8]), StackedMLP(2, 8, [1]))
    out = model(torch.randn(64, 3)).outputs
    assert all(float(o.detach().min()) < 0.0 for o in out)  # a linear last layer reaches below 0
    # the default is make_towers' module, weight for weight
    torch.manual_seed(1)
    a = StackedMLP(2, 8, [4, 1])
    torch.manual_seed(1)
    b = make_towers(2, 8, [4, 1])
    x = torch.randn(5, 8)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_final_activation_true_ends_in_relu() -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        experts = StackedMLP(4, 3, [8], final_activation=True)  # the paper's experts
        assert experts.final_activation
        towers = StackedMLP(2, 8, [1], final_activation=True)
        model = MultiGateMoE(experts, DSelectK(4, 2, num_gates=2), towers)
        MultiGateMoE(StackedMLP(4, 3, [8], final_activation=True), DSelectK(4, 2, num_gates=2),
                     StackedMLP(2, 8, [1], activation="identity"))  # fmt: skip
        SharedBottom(StackedMLP(1, 3, [8]), StackedMLP(2, 8, [4, 1], final_activation=False))
    assert float(experts(torch.randn(16, 3)).detach().min()) >= 0.0
    out = model(torch.randn(64, 3)).outputs
    assert all(float(o.detach().min()) >= 0.0 for o in out)  # a ReLU tower predicts nothing below 0
