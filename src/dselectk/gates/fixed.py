"""A static gate frozen to fixed weights: what :func:`dselectk.export.freeze` puts in place of a
converged static gate."""

from __future__ import annotations

import torch
from torch import Tensor

from dselectk.gates.base import Gate, GateOutput

__all__ = ["FixedGate"]


class FixedGate(Gate):
    """A static gate frozen to fixed weights (a buffer): what :func:`freeze` puts in place.

    Args:
        weights: (n,) for a single gate or (T, n) for a bank of T gates.
        bank: whether ``weights`` holds a bank (``num_gates=T``).

    Examples:
        >>> from dselectk.gates.fixed import FixedGate
        >>> gate = FixedGate(torch.tensor([0.0, 0.7, 0.3, 0.0]))
        >>> gate().weights.nonzero().flatten().tolist(), float(gate().aux_loss)
        ([1, 2], 0.0)
        >>> bool(gate.is_binary()), gate.max_nonzeros
        (True, 2)
        >>> tuple(FixedGate(torch.eye(3), bank=True)().weights.shape)  # a bank of 3 gates
        (3, 3)
    """

    fixed_weights: Tensor

    def __init__(self, weights: Tensor, *, bank: bool = False) -> None:
        if weights.dim() != (2 if bank else 1):
            raise ValueError(f"weights must be {'(T, n)' if bank else '(n,)'}, got {weights.shape}")
        n = weights.shape[-1]
        super().__init__(max(n, 2), num_gates=weights.shape[0] if bank else None)
        self.num_experts = n  # a frozen gate may keep a single expert
        self.register_buffer("fixed_weights", weights.detach().clone())
        self.max_nonzeros = int((weights != 0).sum(-1).max())

    def forward(self, x: Tensor | None = None) -> GateOutput:
        return GateOutput(self.fixed_weights, self.fixed_weights.new_zeros(()))

    @torch.no_grad()
    def is_binary(self, x: Tensor | None = None) -> Tensor:
        """Always True, () or (T,): a frozen selection is final."""
        return self._constant_binary(True, x)

    def freeze_blocker(self, weights: Tensor) -> str | None:
        """None: already frozen."""
        return None
