"""Ablation and research gates: the softmax-selector ablations of Appendix C.1, and DSelect-k
with the research options that measured no gain (:class:`DSelectKExtended`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from torch import Tensor, nn

from dselectk import functional as DF
from dselectk.gates.base import (
    Gate,
    GateOutput,
    HyperParameter,
    check_nonnegative,
    format_hyperparameter,
)
from dselectk.gates.dselect_k import DSelectK

# The autograd node lives in dselectk.kernels.aten; these names are re-exported for code that
# imports them from this module.
from dselectk.kernels.aten import _FLUSH_TEMPERATURE as _FLUSH_TEMPERATURE
from dselectk.kernels.aten import _SelectorGate as _SelectorGate
from dselectk.kernels.aten import _softmax_small as _softmax_small

__all__ = ["DSelectKExtended", "SoftmaxSelectorGate"]

#: the initialisations of :class:`DSelectKExtended`
INITS = ("paper", "spread")


class SoftmaxSelectorGate(Gate):
    """Ablation gate h(α, β) = Σ_{i<=k} σ(α)_i σ(β⁽ⁱ⁾ / τ) (Appendix C.1, "Ablation").

    DSelect-k with each binary-encoded selector r(S(z⁽ⁱ⁾)) replaced by a softmax over the n
    experts. Two ways to push each σ(β⁽ⁱ⁾) to a one-hot vector, as in the paper:

    * "Ablation (Annealing)": anneal the temperature τ from a start s down to 1e-16 on a log
      scale over training (attach a :class:`~dselectk.schedules.GeometricSchedule` to
      ``temperature``); ``entropy_reg=0``.
    * "Ablation (Entropy)": τ = 1 and the auxiliary loss λ Σ_i h(σ(β⁽ⁱ⁾ / τ)).

    Per-gate hyperparameters: in a bank (``num_gates=T``) ``temperature`` and ``entropy_reg``
    may each be one number or T numbers (a sequence or a (T,) tensor), in the constructor or by
    assignment; see :class:`~dselectk.gates.base.HyperParameter`. Gate t then computes what a
    single gate with τ_t and λ_t computes; per-example banks broadcast them over the gate axis.

    Args:
        num_experts: n >= 2.
        k: number of selectors, 1 <= k <= n.
        temperature: τ > 0, or one per gate (settable, schedulable).
        entropy_reg: λ >= 0, or one per gate.
        init_std: β ~ N(0, init_std²) (distinct values avoid the paper's footnote case of ties
            that annealing cannot break); α starts at 0.
        in_features, num_gates, bias: see :class:`~dselectk.gates.base.Gate`.

    Examples:
        >>> from dselectk.gates import SoftmaxSelectorGate
        >>> gate = SoftmaxSelectorGate(6, k=2, entropy_reg=0.1)  # "Ablation (Entropy)"
        >>> w = gate.expert_weights()  # soft: every expert has a weight while training
        >>> tuple(w.shape), bool((w > 0).all())
        ((6,), True)
        >>> int((gate.inference_weights() > 0).sum()) <= 2  # evaluation: argmax of each selector
        True
    """

    posthoc_inference = True
    _temperature: Tensor
    temperature = HyperParameter(positive=True)
    _entropy_reg: Tensor
    entropy_reg = HyperParameter(positive=False)

    def __init__(
        self,
        num_experts: int,
        k: int,
        *,
        in_features: int | None = None,
        temperature: float | Sequence[float] | Tensor = 1.0,
        entropy_reg: float | Sequence[float] | Tensor = 0.0,
        init_std: float = 0.01,
        num_gates: int | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_experts,
            in_features=in_features,
            num_gates=num_gates,
            bias=bias,
        )
        self._set_k(k)
        self.temperature = temperature
        self.entropy_reg = entropy_reg
        self.init_std = init_std
        self._build_logits()
        self._init_parameters()

    @torch.no_grad()
    def _init_parameters(self) -> None:
        """Static logits ~ N(0, init_std²) with α = 0; per-example, the layer's defaults."""
        if self.static:
            nn.init.normal_(self.logits, std=check_nonnegative("init_std", self.init_std))
            self.logits[..., : self.k] = 0.0

    def _logit_shape(self) -> tuple[int, ...]:
        return (self.k * (1 + self.num_experts),)

    def selectors(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """σ(α) (..., K) and the selector outputs σ(β⁽ⁱ⁾/τ) (..., K, n)."""
        alpha = logits[..., : self.k]
        beta = logits[..., self.k :].unflatten(-1, (self.k, self.num_experts))
        tau = self._per_gate(self._temperature, 2)  # per gate: (T, 1, 1) against (*lead, K, n)
        return torch.softmax(alpha, dim=-1), torch.softmax(beta / tau, dim=-1)

    def gate(self, logits: Tensor) -> GateOutput:
        # Same numbers as the weights Σ_i a_i s_i and the entropies of self.selectors(logits)
        # (tested, values and gradients), in one autograd node.
        tau = self._per_gate(self._temperature, 2)
        if torch.compiler.is_exporting() or torch.jit.is_tracing():
            # Export: the node branches on τ's value (torch.export cannot trace that) and the
            # tracing ONNX exporter mis-exports it; the composed ops give the same numbers.
            a, s = self.selectors(logits)
            weights = (a.unsqueeze(-1) * s).sum(dim=-2)
            ent = -(s * torch.log(s.clamp_min(torch.finfo(s.dtype).tiny))).sum(dim=-1)
        else:
            weights, ent = _SelectorGate.apply(logits, tau, self.k)[:2]
        per_gate = self._entropy_reg * ent.sum(dim=-1)
        return GateOutput(weights, self._reduce_aux(per_gate))

    @torch.no_grad()
    def hard_weights(self, x: Tensor | None = None) -> Tensor:
        """Weights after the paper's post-hoc heuristic: each selector replaced by its argmax."""
        a, s = self.selectors(self.compute_logits(x))
        onehot = torch.zeros_like(s).scatter(-1, s.argmax(dim=-1, keepdim=True), 1.0)
        return (a.unsqueeze(-1) * onehot).sum(dim=-2)

    @torch.no_grad()
    def inference_weights(self, x: Tensor | None = None) -> Tensor:
        """:meth:`hard_weights`: the paper evaluates the ablation after its argmax heuristic."""
        return self.hard_weights(x)

    # is_binary: Gate's default, always False: a softmax selector σ(β/τ) is one-hot only in
    # the limit τ → 0 (annealing) or λ → ∞, never exactly; the argmax heuristic of
    # hard_weights makes it final at evaluation, which inference_weights reports.

    @torch.no_grad()
    def diagnostics(self, x: Tensor | None = None) -> dict[str, Tensor]:
        """``selector_entropy`` (entropy of σ(β⁽ⁱ⁾/τ), nats, mean over the selectors) and
        ``collisions`` (pairs i < j of selectors whose argmax is the same expert), each (G,);
        per-example, means over the examples (tokens) of ``x``."""
        t_count = self.num_gates or 1
        _, s = self.selectors(self.compute_logits(None if self.static else x))
        s = s.float().reshape(-1, t_count, *s.shape[-2:])  # (N, T, K, n)
        return {
            "selector_entropy": (-torch.special.xlogy(s, s).sum(-1)).mean((0, 2)),
            "collisions": DF.code_collisions(s.argmax(-1), self.num_experts),
        }

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, k={self.k}, "
            f"temperature={format_hyperparameter(self.temperature)}, "
            f"entropy_reg={format_hyperparameter(self.entropy_reg)}"
        )


class DSelectKExtended(DSelectK):
    """:class:`~dselectk.gates.DSelectK` with two research options of ours against selectors
    collapsing onto one expert, kept for studies and ablations; both measured no gain.

    Selector diversity: with ``diversity=μ > 0`` each gate's auxiliary loss gains
    μ Σ_{i<j} P(selector i and selector j pick the same code). Because each selector
    r(S(z⁽ⁱ⁾)) is the law of M independent bits (Section 3.1.1), this probability is
    ⟨r_i, r_j⟩ = Π_m [p_im p_jm + (1 - p_im)(1 - p_jm)] (p = S(z), bit m of the two codes agrees
    when both are 1 or both are 0), computed in O(K² M) without expanding the 2**M codes. It is 1
    for two identical binary codes and 0 for distinct ones, and its gradient vanishes once S(Z)
    is binary, like the entropy term. With μ = 0 (the default) the term is not computed at all.

    Spread initialisation: ``init="spread"`` starts selector i leaning towards a distinct random
    expert (an offset of ±γ/4 per bit of Z, S = 0.84 or 0.16).

    Measured (``research/notes/per_token.md``; ``tuned_synthetic.json``): on the synthetic study
    (Appendix C.1) the spread init gave MSE 0.13–0.18 at λ = 0.1, worse than the paper's init
    (bits binarize early on random codes, then get no gradient), and the diversity penalty no
    gain at μ ∈ {0.1, 1}; per token (char-LM) μ = 0.1 gives exactly 2 distinct experts but
    +0.0112 ± 0.0065 bits per byte behind Top-k over 9 seeds, and spread with diversity
    2.4762 ± 0.0017 against 2.4765 ± 0.0145 without spread (2 seeds). With ``diversity=0`` and
    ``init="paper"`` the gate is :class:`~dselectk.gates.DSelectK` (the same parameters from the
    same random state, the same outputs). Registered as ``"dselect_k_extended"``.

    Args:
        num_experts, k, in_features, gamma, entropy_reg, xi, distinct, num_gates, bias: as
            :class:`~dselectk.gates.DSelectK`.
        diversity: μ >= 0 of the selector-diversity penalty, or one per gate of a bank (a
            sequence or a (T,) tensor). Settable; a schedule may move it.
        init: "paper" (default): Z (static) or the Z rows of the layer (per-example)
            ~ U(-γ/100, γ/100) (with γ per gate: gate t's rows ~ U(-γ_t/100, γ_t/100)), so every
            S(Z_ij) starts strictly inside (0, 1); "spread": as "paper" plus the offset above.

    Examples:
        >>> from dselectk.gates import DSelectK, DSelectKExtended
        >>> _ = torch.manual_seed(0)
        >>> plain = DSelectK(8, k=2)
        >>> _ = torch.manual_seed(0)
        >>> same = DSelectKExtended(8, k=2)  # at its defaults: DSelectK, draw for draw
        >>> torch.equal(same().weights, plain().weights)
        True
        >>> gate = DSelectKExtended(8, k=2, diversity=0.1, init="spread")
        >>> bits = gate.bits()  # selectors start leaning to distinct codes: S ≈ 0.84 or 0.16
        >>> bool(((bits - 0.5).abs() > 0.3).all())
        True
        >>> float(gate().aux_loss.detach()) > 0  # μ Σ P(two selectors pick the same code)
        True
    """

    _removed_keywords: ClassVar[Mapping[str, str]] = (
        Gate._removed_keywords
    )  # (DSelectK's adds diversity and init)
    _diversity: Tensor
    diversity = HyperParameter(positive=False, optional=True)  # states saved without it load

    def __init__(
        self,
        num_experts: int,
        k: int,
        *,
        in_features: int | None = None,
        gamma: float | Sequence[float] | Tensor = 1.0,
        entropy_reg: float | Sequence[float] | Tensor = 0.0,
        xi: float = 1.0,
        diversity: float | Sequence[float] | Tensor = 0.0,
        init: str = "paper",
        distinct: bool = False,
        num_gates: int | None = None,
        bias: bool = True,
    ) -> None:
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        # read by _init_offset while DSelectK's constructor draws the parameters (a plain
        # attribute may be set before nn.Module's constructor)
        self.init = init
        super().__init__(
            num_experts,
            k,
            in_features=in_features,
            gamma=gamma,
            entropy_reg=entropy_reg,
            xi=xi,
            distinct=distinct,
            num_gates=num_gates,
            bias=bias,
        )
        self.diversity = diversity

    def _init_offset(self, lead: tuple[int, ...]) -> Tensor | None:
        """(*lead, K, M) offsets ±γ/4 towards a distinct random code per selector ("spread"),
        or None ("paper")."""
        if self.init == "paper":
            return None
        picks = [torch.randperm(self.num_experts)[: self.k] for _ in range(math.prod(lead))]
        codes = torch.stack(picks)
        bits = (codes.unsqueeze(-1) >> torch.arange(self.num_bits)) & 1  # (G, K, M)
        gamma = self.gamma
        if isinstance(gamma, Tensor):  # one γ per gate; lead is (T,)
            gamma = gamma.to(bits.device, torch.float32).view(-1, 1, 1)
        return ((bits.float() * 2 - 1) * (gamma / 4)).view(*lead, self.k, self.num_bits)

    def _penalty_on(self) -> bool:
        return type(self).diversity.is_nonzero(self)  # a Python flag: no sync, no graph break

    def _penalty(self, z: Tensor) -> Tensor:
        return self._reduce_aux(self.diversity_penalty(z))

    def diversity_penalty(self, z: Tensor) -> Tensor:
        """μ Σ_{i<j} ⟨r_i, r_j⟩ of each gate (see the class docstring), shape (*lead,).

        Args:
            z: (*lead, K, M) encoding variables.
        """
        p = (z / self._per_gate(self._gamma, 2)).clamp(-0.5, 0.5)
        p = p * (1.5 - 2.0 * p * p) + 0.5  # S(z), (*lead, K, M)
        pi, pj = p.unsqueeze(-2), p.unsqueeze(-3)  # (*lead, K, 1, M), (*lead, 1, K, M)
        same = (pi * pj + (1 - pi) * (1 - pj)).prod(-1)  # (*lead, K, K)
        k = p.shape[-2]
        upper = torch.ones(k, k, dtype=torch.bool, device=p.device).triu(1)
        return self._diversity * (same * upper).sum((-1, -2))

    def extra_repr(self) -> str:
        extra = ""  # DSelectK's repr when the diversity penalty is off
        if type(self).diversity.is_nonzero(self):
            extra = f", diversity={format_hyperparameter(self.diversity)}"
        return f"{super().extra_repr()}{extra}, init={self.init!r}"
