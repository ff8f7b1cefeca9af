"""Softmax-selector ablation gates of Appendix C.1."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from dselectk.gates.base import (
    Gate,
    GateOutput,
    HyperParameter,
    check_nonnegative,
    check_positive_int,
)

__all__ = ["SoftmaxSelectorGate"]


def _softmax_small(x: Tensor) -> Tensor:
    """Softmax along a short last dim (K selectors): cheaper than ``torch.softmax`` there."""
    e = (x - x.amax(dim=-1, keepdim=True)).exp_()
    return e.div_(e.sum(dim=-1, keepdim=True))


#: at or below this temperature the selector node flushes probabilities below float32's
#: smallest normal number to exact zeros before exp (see ``_SelectorGate.forward``)
_FLUSH_TEMPERATURE = 0.05


class _SelectorGate(torch.autograd.Function):
    """(logits (..., K(1+n)), τ, K) -> (Σ_i σ(α)_i σ(β⁽ⁱ⁾/τ) (..., n), entropies (..., K), *saved).

    One autograd node for the gate and the selectors' entropies. The entropy is computed from
    the log-softmax ℓ = log σ(β/τ) (clamped at log(tiny), as :func:`dselectk.functional.entropy`
    clamps the probabilities, so -inf logits and τ -> 0 stay finite) as h = -Σ σ ℓ, and the
    backward pass is written out: with u = σ(α) g_w - g_h ℓ, the grad of β/τ is σ (u - Σ σ u)
    (the softmax backward, into which the entropy's grad -σ (ℓ + h) folds). Exactly one-hot
    selectors (τ -> 0) get an exactly zero grad, before the division by τ. The grad of the
    logits is one tensor (no zero-filled grads of the α and β slices).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(logits: Tensor, temperature: Tensor, k: int) -> tuple[Tensor, ...]:
        alpha = logits[..., :k]
        beta = logits[..., k:].unflatten(-1, (k, -1))
        a = _softmax_small(alpha)  # (..., K)
        log_s = torch.log_softmax(beta / temperature, dim=-1)  # (..., K, n)
        log_tiny = math.log(torch.finfo(log_s.dtype).tiny)
        if log_s.device.type == "cpu" and bool((temperature <= _FLUSH_TEMPERATURE).any()):
            # At small τ most log-probabilities lie far below exp's range, where the CPU's
            # vectorized exp takes a slow path (15x slower measured at τ = 1e-3 after
            # training): exponentiate 0 there instead and write the exact zeros afterwards.
            # Same s except that denormal probabilities (< 1.2e-38) become 0. Decided on τ,
            # not on the data, so the node has no data-dependent branch (torch.func works).
            under = log_s < log_tiny
            s = log_s.masked_fill(under, 0.0).exp_().masked_fill_(under, 0.0)
        else:
            s = log_s.exp()
        log_s = log_s.clamp_min_(log_tiny)
        weights = (a.unsqueeze(-1) * s).sum(dim=-2)
        ent = (s * log_s).sum(dim=-1).neg_()
        return weights, ent, a, s, log_s

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*output[2:])
        ctx.save_for_backward(inputs[1], *output[2:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, g_w: Tensor | None, g_ent: Tensor | None, *_: Any
    ) -> tuple[Tensor | None, None, None]:
        temperature, a, s, log_s = ctx.saved_tensors
        if g_w is None and g_ent is None:
            return None, None, None
        if g_w is not None:
            gw = g_w.unsqueeze(-2)
            u = a.unsqueeze(-1) * gw  # grad of s from the weights
            g_a = (s * gw).sum(dim=-1)
            if g_ent is not None:
                u.addcmul_(g_ent.unsqueeze(-1), log_s, value=-1.0)
        else:
            assert g_ent is not None
            u = (g_ent.unsqueeze(-1) * log_s).neg_()
            g_a = torch.zeros_like(a)
        g_beta = u.sub_((s * u).sum(dim=-1, keepdim=True)).mul_(s).div_(temperature)
        g_alpha = a * (g_a - (g_a * a).sum(dim=-1, keepdim=True))  # softmax backward
        return torch.cat((g_alpha, g_beta.flatten(-2)), dim=-1), None, None


class SoftmaxSelectorGate(Gate):
    """Ablation gate h(α, β) = Σ_{i<=k} σ(α)_i σ(β⁽ⁱ⁾ / τ) (Appendix C.1, "Ablation").

    DSelect-k with each binary-encoded selector r(S(z⁽ⁱ⁾)) replaced by a softmax over the n
    experts. Two ways to push each σ(β⁽ⁱ⁾) to a one-hot vector, as in the paper:

    * "Ablation (Annealing)": anneal the temperature τ from a start s down to 1e-16 on a log
      scale over training (attach a :class:`~dselectk.schedules.GeometricSchedule` to
      ``temperature``); ``entropy_reg=0``.
    * "Ablation (Entropy)": τ = 1 and the auxiliary loss λ Σ_i h(σ(β⁽ⁱ⁾ / τ)).

    Args:
        num_experts: n >= 2.
        k: number of selectors, 1 <= k <= n.
        temperature: τ > 0 (settable, schedulable).
        entropy_reg: λ >= 0.
        init_std: β ~ N(0, init_std²) (distinct values avoid the paper's footnote case of ties
            that annealing cannot break); α starts at 0.
        in_features, num_gates, bias, check_finite: see :class:`~dselectk.gates.base.Gate`.
    """

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
        temperature: float = 1.0,
        entropy_reg: float = 0.0,
        init_std: float = 0.01,
        num_gates: int | None = None,
        bias: bool = True,
        check_finite: bool = False,
    ) -> None:
        super().__init__(
            num_experts,
            in_features=in_features,
            num_gates=num_gates,
            bias=bias,
            check_finite=check_finite,
        )
        self.k = check_positive_int("k", k)
        if k > num_experts:
            raise ValueError(f"k must be <= num_experts ({num_experts}), got {k}")
        self.temperature = temperature
        self.entropy_reg = entropy_reg
        self._build_logits()
        if self.static:
            with torch.no_grad():
                nn.init.normal_(self.logits, std=check_nonnegative("init_std", init_std))
                self.logits[..., :k] = 0.0

    def _logit_shape(self) -> tuple[int, ...]:
        return (self.k * (1 + self.num_experts),)

    def selectors(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """σ(α) (..., K) and the selector outputs σ(β⁽ⁱ⁾/τ) (..., K, n)."""
        alpha = logits[..., : self.k]
        beta = logits[..., self.k :].unflatten(-1, (self.k, self.num_experts))
        return torch.softmax(alpha, dim=-1), torch.softmax(beta / self._temperature, dim=-1)

    def gate(self, logits: Tensor) -> GateOutput:
        # Same numbers as the weights Σ_i a_i s_i and the entropies of self.selectors(logits)
        # (tested, values and gradients), in one autograd node.
        weights, ent = _SelectorGate.apply(logits, self._temperature, self.k)[:2]
        per_gate = self._entropy_reg * ent.sum(dim=-1)
        return GateOutput(weights, self._reduce_aux(per_gate))

    @torch.no_grad()
    def hard_weights(self, x: Tensor | None = None) -> Tensor:
        """Weights after the paper's post-hoc heuristic: each selector replaced by its argmax."""
        a, s = self.selectors(self.compute_logits(x))
        onehot = torch.zeros_like(s).scatter(-1, s.argmax(dim=-1, keepdim=True), 1.0)
        return (a.unsqueeze(-1) * onehot).sum(dim=-2)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, k={self.k}, temperature={self.temperature:g}, "
            f"entropy_reg={self.entropy_reg:g}"
        )
