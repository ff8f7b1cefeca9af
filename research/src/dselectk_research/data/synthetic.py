"""The synthetic data of Appendix C.1: 128 regression tasks in 8 groups of 16.

Each group has its own MoE of 4 experts; each expert is the sum of 4 ReLU units with N(0, 1)
weights (no biases). Task t of a group outputs y⁽ᵗ⁾(x) = Σ_i σ(α⁽ᵗ⁾)_i f_i(x), where the 16 task
weight vectors of a group are drawn jointly from a zero-mean normal with unit variance per
coordinate and pairwise task correlation 0.8 (coordinates independent). X has 140,000 N(0, 1)
rows of 10 features shared by all tasks (100k train / 20k validation / 20k test).

8 groups of 16, not the paper's "four groups": 16 tasks per group and T/4 generator experts for T
tasks mean T/16 groups, so 128 tasks are 8 groups, and the T-task problem takes the first T/16
groups (see ``dselectk reproduce synthetic``'s report for the other choices).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "EXPERTS_PER_GROUP",
    "FEATURES",
    "NUM_GROUPS",
    "TASKS_PER_GROUP",
    "UNITS",
    "SyntheticData",
    "generate_data",
]

NUM_GROUPS = 8  # see the package docstring: 128 tasks / 16 per group
TASKS_PER_GROUP = 16
EXPERTS_PER_GROUP = 4
UNITS = 4
FEATURES = 10


@dataclass
class SyntheticData:
    """The 128-task data set: inputs shared by all tasks, targets (N, 128) per split."""

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_test: Tensor
    y_test: Tensor
    groups: Tensor
    """(128,) group of each task: tasks 16g..16g+15 form group g (8 groups)."""
    alpha: Tensor
    """(128, 4) task weight vectors α⁽ᵗ⁾ (float64)."""
    expert_weights: Tensor
    """(8 groups, 4 experts, 10, 4 units) generator weights (float64)."""


def generate_data(
    seed: int = 0,
    n_train: int = 100_000,
    n_val: int = 20_000,
    n_test: int = 20_000,
    correlation: float = 0.8,
) -> SyntheticData:
    """Generate the Appendix C.1 data, deterministically from ``seed`` (float64, then float32).

    Args:
        seed: seed of a private generator (the global RNG is untouched).
        n_train, n_val, n_test: split sizes (paper: 100k / 20k / 20k).
        correlation: pairwise correlation of the task weights within a group (paper: 0.8).
    """
    g = torch.Generator().manual_seed(seed)
    n = n_train + n_val + n_test
    x = torch.randn(n, FEATURES, generator=g, dtype=torch.float64)
    cov = torch.full((TASKS_PER_GROUP, TASKS_PER_GROUP), correlation, dtype=torch.float64)
    cov.fill_diagonal_(1.0)
    chol = torch.linalg.cholesky(cov)
    ys, alphas, ws = [], [], []
    for _ in range(NUM_GROUPS):
        w = torch.randn(EXPERTS_PER_GROUP, FEATURES, UNITS, generator=g, dtype=torch.float64)
        f = torch.relu(torch.einsum("np,epu->neu", x, w)).sum(-1)  # (N, 4): expert outputs
        # Column i of alpha holds coordinate i of the 16 task vectors, ~ N(0, cov).
        alpha = chol @ torch.randn(TASKS_PER_GROUP, EXPERTS_PER_GROUP, generator=g, dtype=x.dtype)
        ys.append(f @ torch.softmax(alpha, dim=-1).T)  # (N, 16)
        alphas.append(alpha)
        ws.append(w)
    y = torch.cat(ys, dim=1).float()
    xf = x.float()
    a, b = n_train, n_train + n_val
    return SyntheticData(
        x_train=xf[:a],
        y_train=y[:a].contiguous(),
        x_val=xf[a:b],
        y_val=y[a:b].contiguous(),
        x_test=xf[b:],
        y_test=y[b:].contiguous(),
        groups=torch.arange(NUM_GROUPS).repeat_interleave(TASKS_PER_GROUP),
        alpha=torch.cat(alphas),
        expert_weights=torch.stack(ws),
    )
