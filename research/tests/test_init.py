"""Keras-style initialisation (dselectk_research.keras_init) against its definition."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dselectk.gates import make_gate
from dselectk.layers import StackedMLP
from dselectk.models.moe import MultiGateMoE
from dselectk_research.cnn import BatchedCNNExperts
from dselectk_research.keras_init import (
    EMBEDDING_LIMIT,
    glorot_limit,
    init_module_,
    keras_init_,
)


def _check_uniform(t: torch.Tensor, limit: float) -> None:
    """Bounds, mean ≈ 0 and variance ≈ limit²/3 of U(−limit, limit) samples."""
    v = t.detach().double().flatten()
    n = v.numel()
    assert float(v.abs().max()) <= limit
    assert float(v.abs().max()) > 0.95 * limit  # fills the interval
    var = limit**2 / 3
    assert abs(float(v.mean())) < 5 * math.sqrt(var / n)
    # sample variance of a uniform: relative sd sqrt(0.8 / n)
    assert float(v.var()) == pytest.approx(var, rel=6 * math.sqrt(0.8 / n))


def test_glorot_limit() -> None:
    assert glorot_limit(300, 200) == pytest.approx(math.sqrt(6 / 500))
    with pytest.raises(ValueError):
        glorot_limit(0, 3)


def test_embedding_and_linear() -> None:
    torch.manual_seed(0)
    emb, lin = nn.Embedding(2000, 32), nn.Linear(300, 200)
    keras_init_(nn.Sequential(emb, lin))
    _check_uniform(emb.weight, EMBEDDING_LIMIT)
    _check_uniform(lin.weight, glorot_limit(300, 200))
    assert torch.count_nonzero(lin.bias) == 0


def test_stacked_mlp_uses_one_members_fans() -> None:
    torch.manual_seed(0)
    m = StackedMLP(6, 120, [256, 40], final_activation=True)
    keras_init_(m)
    for w, b, (fi, fo) in zip(m.weights, m.biases, ((120, 256), (256, 40))):
        for e in range(6):
            _check_uniform(w[e], glorot_limit(fi, fo))
        assert torch.count_nonzero(b) == 0
    assert not torch.equal(m.weights[0][0], m.weights[0][1])  # members drawn independently


def test_conv_receptive_field_fans() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 32, 3)
    keras_init_(conv)
    _check_uniform(conv.weight, glorot_limit(16 * 9, 32 * 9))
    assert conv.bias is not None and torch.count_nonzero(conv.bias) == 0
    bank = BatchedCNNExperts(8, (1, 36, 36))
    keras_init_(bank)
    # Keras Conv2D(10, 5) on 1 channel: fans 1·25 and 10·25; Conv2D(20, 5) on 10: 250, 500
    for e in range(8):
        _check_uniform(bank.conv2_weight[e * 20 : (e + 1) * 20], glorot_limit(250, 500))
    _check_uniform(bank.conv1_weight, glorot_limit(25, 250))
    assert torch.count_nonzero(bank.conv1_bias) == 0 and torch.count_nonzero(bank.conv2_bias) == 0
    fin = bank.flat_features
    _check_uniform(bank.dense.weights[0], glorot_limit(fin, 50))
    assert torch.count_nonzero(bank.dense.biases[0]) == 0


def test_gates_keep_their_initialisation_unless_asked() -> None:
    torch.manual_seed(0)
    gate = make_gate("dselect_k", 8, k=2, num_gates=2, in_features=20)
    model = MultiGateMoE(
        StackedMLP(8, 20, [16], final_activation=True),
        gate,
        StackedMLP(2, 16, [1], final_activation=True),
    )
    before = {k: v.clone() for k, v in gate.state_dict().items()}
    keras_init_(model)
    assert all(torch.equal(before[k], v) for k, v in gate.state_dict().items())
    keras_init_(model, gates=True)
    assert not all(torch.equal(before[k], v) for k, v in gate.state_dict().items())


def test_init_module_names() -> None:
    lin = nn.Linear(4, 3)
    w = lin.weight.clone()
    assert init_module_(lin, "torch") is lin and torch.equal(lin.weight, w)
    init_module_(lin, "keras")
    assert torch.count_nonzero(lin.bias) == 0
    with pytest.raises(ValueError, match="init must be"):
        init_module_(lin, "xavier")
