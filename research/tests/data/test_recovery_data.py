"""The generated data of the expert-recovery study (dselectk_research.data.recovery)."""

from __future__ import annotations

import torch

from dselectk_research.data.recovery import FEATURES, UNITS, RecoveryData, expert_outputs


def test_recovery_data_is_seeded_balanced_and_leaves_the_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a, b = RecoveryData(3, n_train=200, n_val=100, num_true=2), RecoveryData(3, 200, 100, 2)
    assert torch.equal(torch.get_rng_state(), state)
    assert a.true_experts.shape == (2, FEATURES, UNITS) and a.x_train.shape == (200, FEATURES)
    assert a.x_val.shape == (100, FEATURES) and a.y_val.shape == (100,)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_val, b.y_val)
    assert not torch.equal(a.x_train, RecoveryData(4, 200, 100, 2).x_train)
    y = torch.cat([a.y_train, a.y_val])
    assert set(y.unique().tolist()) <= {0.0, 1.0} and abs(float(y.mean()) - 0.5) < 0.01


def test_expert_outputs_are_relu_dense_experts_without_bias() -> None:
    x, w = torch.randn(5, FEATURES), torch.randn(2, 3, FEATURES, UNITS)
    out = expert_outputs(x, w)
    assert out.shape == (2, 3, 5, UNITS)
    assert torch.allclose(out[1, 2], torch.relu(x @ w[1, 2]))
