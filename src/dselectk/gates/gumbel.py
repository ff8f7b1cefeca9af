"""Gumbel-softmax gate of Appendix D (after AdaShare, Sun et al., 2020)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dselectk.gates.base import Gate, GateOutput, HyperParameter, format_hyperparameter

__all__ = ["GumbelSoftmaxGate"]


class GumbelSoftmaxGate(Gate):
    """d(α, U)_i = σ(α)_i U_i with binary U_i ~ Bernoulli(ψ_i) learned by the Gumbel-softmax trick.

    Appendix D ("Gumbel-softmax Gate"): each expert i has a keep/drop variable U_i with
    ψ_i = σ(ℓ_i). In training, U is sampled with the two-class Gumbel-softmax (binary Concrete)
    relaxation at temperature τ, hard (straight-through) by default as in AdaShare; in eval, U_i
    is the most likely value, 1[ψ_i > 1/2]. The auxiliary loss is AdaShare's sparsity penalty
    λ Σ_i log ψ_i, which pushes ψ towards 0 (fewer experts); note that it is unbounded below and
    only the data loss balances it, so it cannot fix the number of experts the way k does.

    Differences from the paper: none intended. Like the paper's gate, the output is *not* on the
    simplex (Σ_i d_i = Σ_{i: U_i=1} σ(α)_i <= 1, and 0 if no expert is kept).

    In a bank (``num_gates=T``) ``sparsity_reg`` and ``temperature`` may each be one number or T
    numbers, one per gate (see :class:`~dselectk.gates.base.HyperParameter`).

    Args:
        num_experts: n >= 2.
        sparsity_reg: λ >= 0, or one per gate.
        temperature: τ > 0 of the relaxation, or one per gate (settable, schedulable; AdaShare
            anneals it).
        hard: straight-through hard samples in training (AdaShare) or soft relaxed samples.
        init_keep_logit: initial ℓ_i (ψ_i = σ(ℓ_i)); the default 2.0 keeps ~88 % of the experts
            at the start, as AdaShare initialises its policy towards executing every block.
        in_features, num_gates, bias: see :class:`~dselectk.gates.base.Gate`.

    Examples:
        >>> from dselectk import GumbelSoftmaxGate
        >>> gate = GumbelSoftmaxGate(4, sparsity_reg=0.01).eval()  # eval: U_i = 1[ψ_i > 1/2]
        >>> gate().weights.tolist()  # every expert kept at the start, σ(α) uniform
        [0.25, 0.25, 0.25, 0.25]
        >>> gate = GumbelSoftmaxGate(4, in_features=16)  # per-example; training mode samples U
        >>> tuple(gate(torch.randn(4, 16)).weights.shape)
        (4, 4)
    """

    on_simplex = False
    _temperature: Tensor
    temperature = HyperParameter(positive=True)
    _sparsity_reg: Tensor
    sparsity_reg = HyperParameter(positive=False)

    def __init__(
        self,
        num_experts: int,
        *,
        in_features: int | None = None,
        sparsity_reg: float | Sequence[float] | Tensor = 0.0,
        temperature: float | Sequence[float] | Tensor = 1.0,
        hard: bool = True,
        init_keep_logit: float = 2.0,
        num_gates: int | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_experts,
            in_features=in_features,
            num_gates=num_gates,
            bias=bias,
        )
        self.hard = bool(hard)
        self.temperature = temperature
        self.sparsity_reg = sparsity_reg
        self.init_keep_logit = float(init_keep_logit)
        self._build_logits()
        self._init_parameters()

    @torch.no_grad()
    def _init_parameters(self) -> None:
        """Static: α = 0 and keep logits ``init_keep_logit``; per-example: the layer's default
        weights and the keep logits' biases set to ``init_keep_logit``."""
        n = self.num_experts
        if self.static:
            self.logits.zero_()
            self.logits[..., n:] = self.init_keep_logit
        elif self.proj is not None and self.proj.bias is not None:
            b = self.proj.bias.view(-1, 2 * n)
            b[:, n:] = self.init_keep_logit

    def _logit_shape(self) -> tuple[int, ...]:
        return (2 * self.num_experts,)  # α (n) then the keep logits ℓ (n)

    def gate(self, logits: Tensor) -> GateOutput:
        alpha, keep = logits.split(self.num_experts, dim=-1)
        if self.training:
            # Two-class Gumbel-softmax == binary Concrete: the difference of two Gumbels is
            # logistic noise.
            u = torch.rand_like(keep).clamp(1e-6, 1 - 1e-6)
            tau = self._per_gate(self._temperature, 1)  # per gate: (T, 1) against (*lead, n)
            soft = torch.sigmoid((keep + torch.log(u) - torch.log1p(-u)) / tau)
            mask = soft
            if self.hard:
                mask = (soft > 0.5).to(soft.dtype) + soft - soft.detach()
        else:
            mask = (keep > 0).to(keep.dtype)
        weights = torch.softmax(alpha, dim=-1) * mask
        penalty = self._sparsity_reg * F.logsigmoid(keep).sum(dim=-1)
        return GateOutput(weights, self._reduce_aux(penalty))

    @torch.no_grad()
    def is_binary(self, x: Tensor | None = None) -> Tensor:
        """Always True (1.0 per-example): the eval-mode selection, the mask 1[ℓ > 0], is hard.

        In training mode the mask is a (relaxed) random sample; this answers for evaluation.
        """
        return self._constant_binary(True, x)

    @torch.no_grad()
    def diagnostics(self, x: Tensor | None = None) -> dict[str, Tensor]:
        """``expected_nonzeros``: Σ_i ψ_i, the expected number of kept experts, (G,).

        Per-example: the mean over the examples (tokens) of ``x``.
        """
        e = self.expected_nonzeros(None if self.static else x)
        return {"expected_nonzeros": e.reshape(-1, self.num_gates or 1).mean(0)}

    def freeze_blocker(self, weights: Tensor) -> str | None:
        """None: the eval-mode weights use the hard mask 1[ℓ > 0]."""
        return None

    @torch.no_grad()
    def keep_probability(self, x: Tensor | None = None) -> Tensor:
        """ψ = σ(ℓ): probability that each expert is kept, shaped like the weights."""
        return torch.sigmoid(self.compute_logits(x)[..., self.num_experts :])

    @torch.no_grad()
    def expected_nonzeros(self, x: Tensor | None = None) -> Tensor:
        """E[number of selected experts] = Σ_i ψ_i, per gate (static) or per example."""
        return self.keep_probability(x).sum(dim=-1)

    def extra_repr(self) -> str:
        temperature = format_hyperparameter(self.temperature)
        return f"{super().extra_repr()}, temperature={temperature}, hard={self.hard}"
