"""The generated data of the expert-recovery study (Appendix C.2.2).

A data-generating MoE of ``num_true`` ReLU experts (dense, ``UNITS`` = 4 units, no bias, on
``FEATURES`` = 10 Gaussian features) labels Gaussian inputs: the label is 1 where the experts'
average, through a random linear head, lies above its median (balanced classes).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FEATURES", "NUM_TRUE", "UNITS", "RecoveryData", "expert_outputs"]

#: the paper's number of generating experts (the default of ``num_true``)
NUM_TRUE = 4
UNITS, FEATURES = 4, 10


class RecoveryData:
    """The generated data (x: (N, 10), y: (N,) in {0, 1}) and ``true_experts`` (num_true, 10,
    4), drawn from a private generator (the global RNG is untouched)."""

    def __init__(
        self, seed: int = 0, n_train: int = 10_000, n_val: int = 10_000, num_true: int = NUM_TRUE
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.true_experts = torch.randn(num_true, FEATURES, UNITS, generator=g)
        self.head = torch.randn(UNITS, generator=g)
        x = torch.randn(n_train + n_val, FEATURES, generator=g)
        pre = expert_outputs(x, self.true_experts).mean(0) @ self.head  # the experts' average
        self.bias = pre.median()  # subtracted: balanced classes
        y = (pre - self.bias > 0).float()
        self.x_train, self.y_train = x[:n_train], y[:n_train]
        self.x_val, self.y_val = x[n_train:], y[n_train:]
        self.seed, self.num_true = seed, num_true

    def labels(self, x: Tensor) -> Tensor:
        """The generating model's labels (N,) in {0, 1} of inputs ``x`` (N, 10)."""
        return ((expert_outputs(x, self.true_experts).mean(0) @ self.head - self.bias) > 0).float()

    def held_out(self, n: int, seed: int) -> tuple[Tensor, Tensor]:
        """``n`` more examples (x, y) of the same generating model (true experts, head and
        bias), their inputs drawn from a generator seeded with ``seed``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"held_out: n must be an integer >= 1, got {n!r}")
        x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(int(seed)))
        return x, self.labels(x)


def expert_outputs(x: Tensor, weights: Tensor) -> Tensor:
    """ReLU dense experts without bias: x (B, p), weights (..., E, p, u) → (..., E, B, u)."""
    return torch.relu(torch.einsum("bp,...epu->...ebu", x, weights))
