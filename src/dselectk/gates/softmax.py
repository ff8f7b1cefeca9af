"""Dense softmax gate (Section 2)."""

from __future__ import annotations

import torch
from torch import nn

from dselectk.gates.base import Gate, GateOutput

__all__ = ["SoftmaxGate"]


class SoftmaxGate(Gate):
    """Softmax gate σ(Ax + b) (Jordan & Jacobs, 1994; Section 2 of the paper).

    Dense: every expert gets a positive weight. Static when ``in_features`` is None (the paper's
    A = 0), in which case the logits b are parameters initialised at zero (uniform weights).

    Args:
        num_experts, in_features, num_gates, bias: see
            :class:`~dselectk.gates.base.Gate`.

    Examples:
        >>> from dselectk import SoftmaxGate
        >>> SoftmaxGate(4)().weights.tolist()  # static, logits start at 0
        [0.25, 0.25, 0.25, 0.25]
        >>> w = SoftmaxGate(4, in_features=16)(torch.randn(4, 16)).weights
        >>> tuple(w.shape), bool((w > 0).all())  # (batch, experts), dense
        ((4, 4), True)
    """

    def __init__(
        self,
        num_experts: int,
        *,
        in_features: int | None = None,
        num_gates: int | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_experts,
            in_features=in_features,
            num_gates=num_gates,
            bias=bias,
        )
        self._build_logits()
        self._init_parameters()

    @torch.no_grad()
    def _init_parameters(self) -> None:
        """Static logits 0 (uniform weights); per-example, the layer's default weights."""
        if self.static:
            nn.init.zeros_(self.logits)

    def _logit_shape(self) -> tuple[int, ...]:
        return (self.num_experts,)

    def gate(self, logits: torch.Tensor) -> GateOutput:
        return GateOutput(torch.softmax(logits, dim=-1), logits.new_zeros(()))
