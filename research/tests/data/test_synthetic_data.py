"""The Appendix C.1 data generator (:mod:`dselectk_research.data.synthetic`)."""

from __future__ import annotations

import pytest
import torch

from dselectk_research.data import synthetic as S


def test_data_shapes_splits_and_determinism() -> None:
    d = S.generate_data(3, n_train=100, n_val=20, n_test=30)
    assert d.x_train.shape == (100, 10) and d.y_train.shape == (100, 128)
    assert d.x_val.shape == (20, 10) and d.y_val.shape == (20, 128)
    assert d.x_test.shape == (30, 10) and d.y_test.shape == (30, 128)
    assert d.groups.tolist() == [g for g in range(8) for _ in range(16)]
    d2 = S.generate_data(3, n_train=100, n_val=20, n_test=30)
    for a, b in [(d.x_train, d2.x_train), (d.y_test, d2.y_test), (d.alpha, d2.alpha)]:
        assert torch.equal(a, b)
    d3 = S.generate_data(4, n_train=100, n_val=20, n_test=30)
    assert not torch.equal(d.y_train, d3.y_train)
    state = torch.random.get_rng_state()
    S.generate_data(5, n_train=10, n_val=5, n_test=5)
    assert torch.equal(state, torch.random.get_rng_state())  # global RNG untouched


def test_data_recipe_mixture_of_relu_experts() -> None:
    d = S.generate_data(1, n_train=50, n_val=10, n_test=10)
    x = torch.cat([d.x_train, d.x_val, d.x_test]).double()
    for t in [0, 17, 127]:
        g = t // 16
        f = torch.relu(torch.einsum("np,epu->neu", x, d.expert_weights[g])).sum(-1)
        y = f @ torch.softmax(d.alpha[t], dim=-1)
        got = torch.cat([d.y_train[:, t], d.y_val[:, t], d.y_test[:, t]]).double()
        assert torch.allclose(got, y, rtol=1e-5, atol=1e-5)


def test_task_weights_correlated_within_group() -> None:
    # 30 seeds x 8 groups x 4 coordinates = 960 draws of the 16 tasks' weights.
    cols = []
    for seed in range(30):
        a = S.generate_data(seed, n_train=4, n_val=2, n_test=2).alpha  # (128, 4)
        cols.append(a.view(8, 16, 4).permute(0, 2, 1).reshape(-1, 16))
    samples = torch.cat(cols)  # (960, 16)
    c = torch.corrcoef(samples.T)
    off = c[~torch.eye(16, dtype=torch.bool)]
    assert float(off.mean()) == pytest.approx(0.8, abs=0.04)
    assert float(samples.var(0).mean()) == pytest.approx(1.0, abs=0.1)
    # different groups are independent: 120 pairs (seed, coordinate), standard error ~0.09
    g0, g1 = samples.view(30, 8, 4, 16)[:, 0], samples.view(30, 8, 4, 16)[:, 1]
    cross = torch.corrcoef(torch.stack([g0[..., 0].flatten(), g1[..., 0].flatten()]))[0, 1]
    assert abs(float(cross)) < 0.35
