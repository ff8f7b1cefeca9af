"""Top-k gate σ(KeepTopK(Ax + b)) (Section 2; Shazeer et al., 2017)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dselectk import functional as DF
from dselectk.gates.base import Gate, GateOutput, check_nonnegative

__all__ = ["TopKGate", "cv_squared"]


def cv_squared(x: Tensor) -> Tensor:
    """Squared coefficient of variation along the last dim (Shazeer et al.'s balancing loss).

    Examples:
        >>> float(cv_squared(torch.tensor([1.0, 1.0, 1.0, 1.0])))  # balanced load
        0.0
        >>> round(float(cv_squared(torch.tensor([2.0, 0.0, 2.0, 0.0]))), 4)  # var / mean²
        1.3333
        >>> tuple(cv_squared(torch.rand(3, 8)).shape)  # one value per row
        (3,)
    """
    if x.shape[-1] < 2:
        return x.new_zeros(x.shape[:-1])
    return x.var(dim=-1) / (x.mean(dim=-1) ** 2 + 1e-10)


class TopKGate(Gate):
    """Top-k gate: softmax over the k largest logits, zero elsewhere (Section 2).

    Options from Shazeer et al. (2017), both off by default because the paper's comparison does
    not use them: ``noisy=True`` adds trainable Gaussian noise to the logits during training
    (per-example gates only), and ``balance_weight > 0`` adds the importance loss
    CV²(Σ_batch g(x)) and, when noisy, the load loss CV²(Σ_batch P(x, i)). Balancing is only
    defined for per-example gates.

    Static gates initialise their logits ~ N(0, init_std²) so that the initial top k is random
    rather than the first k experts.

    Args:
        num_experts: n >= 2.
        k: 1 <= k <= n.
        in_features, num_gates, bias: see :class:`~dselectk.gates.base.Gate`.
        noisy: noisy top-k gating (per-example only).
        balance_weight: weight of the balancing losses (per-example only).
        init_std: standard deviation of the initial static logits.

    Examples:
        >>> from dselectk import TopKGate
        >>> gate = TopKGate(num_experts=8, k=2, in_features=16)
        >>> w = gate(torch.randn(4, 16)).weights  # (batch, experts)
        >>> tuple(w.shape), (w > 0).sum(-1).tolist(), w.sum(-1).allclose(torch.ones(4))
        ((4, 8), [2, 2, 2, 2], True)
        >>> int(TopKGate(8, k=2).num_selected())  # static: k experts from the start
        2
    """

    searchable = True

    def __init__(
        self,
        num_experts: int,
        k: int,
        *,
        in_features: int | None = None,
        num_gates: int | None = None,
        bias: bool = True,
        noisy: bool = False,
        balance_weight: float = 0.0,
        init_std: float = 0.01,
    ) -> None:
        super().__init__(
            num_experts,
            in_features=in_features,
            num_gates=num_gates,
            bias=bias,
        )
        self._set_k(k)
        self.max_nonzeros = self.k
        self.balance_weight = check_nonnegative("balance_weight", balance_weight)
        self.noisy = bool(noisy)
        if self.static and (self.noisy or self.balance_weight > 0):
            raise ValueError(
                "noisy gating and balance_weight need a per-example gate (pass in_features)"
            )
        self.init_std = init_std
        self._build_logits()
        self.noise_proj: nn.Linear | None = None
        if self.static:
            self._init_parameters()
        elif self.noisy:  # (static and noisy exclude each other: the draws keep their order)
            assert self.in_features is not None
            g = 1 if self.num_gates is None else self.num_gates
            self.noise_proj = nn.Linear(self.in_features, g * num_experts, bias=bias)
            self._init_parameters()

    @torch.no_grad()
    def _init_parameters(self) -> None:
        """Static logits ~ N(0, init_std²); per-example, the layers' default weights, with the
        noise layer's weights at 0 (no noise at first)."""
        if self.static:
            nn.init.normal_(self.logits, std=check_nonnegative("init_std", self.init_std))
        if self.noise_proj is not None:
            nn.init.zeros_(self.noise_proj.weight)

    def _logit_shape(self) -> tuple[int, ...]:
        return (self.num_experts,)

    def forward(self, x: Tensor | None = None) -> GateOutput:
        clean = self.compute_logits(x)
        if not (self.noisy and self.training):
            return self.gate(clean)
        assert self.noise_proj is not None and x is not None
        std = F.softplus(self.noise_proj(x)).view_as(clean) + 1e-2
        noisy = clean + torch.randn_like(clean) * std
        out = self.gate(noisy)
        if self.balance_weight > 0:
            load = self._load(clean, noisy, std).sum(dim=0)  # (*gates, n)
            aux = out.aux_loss + self.balance_weight * cv_squared(load).sum()
            return GateOutput(out.weights, aux)
        return out

    def gate(self, logits: Tensor) -> GateOutput:
        weights = DF.topk_softmax(logits, self.k)
        aux = logits.new_zeros(())
        if self.balance_weight > 0:
            importance = weights.sum(dim=0)  # (*gates, n)
            aux = self.balance_weight * cv_squared(importance).sum()
        return GateOutput(weights, aux)

    def _load(self, clean: Tensor, noisy: Tensor, std: Tensor) -> Tensor:
        """P(x, i): probability that expert i stays in the top k under a fresh noise draw."""
        k = self.k
        top = noisy.topk(min(k + 1, self.num_experts), dim=-1).values
        threshold_in = top[..., k : k + 1] if k < self.num_experts else top[..., -1:]
        threshold_out = top[..., k - 1 : k]
        is_in = noisy > threshold_in
        normal = torch.distributions.Normal(clean.new_zeros(()), clean.new_ones(()))
        prob_in = normal.cdf((clean - threshold_in) / std)
        prob_out = normal.cdf((clean - threshold_out) / std)
        return torch.where(is_in, prob_in, prob_out)

    @torch.no_grad()
    def is_binary(self, x: Tensor | None = None) -> Tensor:
        """Always True (1.0 per-example): the k selected experts are a hard selection."""
        return self._constant_binary(True, x)

    @torch.no_grad()
    def selection(self) -> Tensor:
        """The k selected experts by decreasing logit, long (K,) or (T, K)."""
        self._require_searchable("read")
        return self.logits.topk(self.k, dim=-1).indices

    @torch.no_grad()
    def selection_is_final(self) -> Tensor:
        """All True, (K,) or (T, K): the top k is a hard selection."""
        return torch.ones_like(self.selection(), dtype=torch.bool)

    @torch.no_grad()
    def set_selection(self, experts: Tensor, *, scale: float = 1.0) -> None:
        """Swap logits so that ``experts[..., i]`` holds slot i of the top k (-1: keep it).

        Slot by slot, the expert holding slot i and the requested one exchange their logits,
        so the logits keep their values (the weights, as a set, are unchanged) and the other
        experts keep theirs. ``scale`` is ignored. The experts selected afterwards must be
        distinct.
        """
        self._require_searchable("write")
        n, k = self.num_experts, self.k
        e = self._check_experts(experts, (*self._gate_lead(), k)).to(self.logits.device)
        logits = self.logits.view(-1, n)  # (G, n), a view of the parameter
        current = logits.topk(k, dim=-1).indices
        final = torch.where(e >= 0, e, current)
        ranked = final.sort(-1).values
        if bool((ranked[:, 1:] == ranked[:, :-1]).any()):
            raise ValueError(
                "experts: a Top-k gate selects k distinct experts; the requested selection "
                "repeats one (with the kept slots)"
            )
        rows = torch.arange(logits.shape[0], device=logits.device)
        for slot in range(k):
            out = logits.topk(k, dim=-1).indices[:, slot]
            new = e[:, slot]
            move = (new >= 0) & (new != out)
            if not bool(move.any()):
                continue
            r, o, t = rows[move], out[move], new[move]
            held, wanted = logits[r, o].clone(), logits[r, t].clone()
            logits[r, o], logits[r, t] = wanted, held

    @torch.no_grad()
    def selector_weights(self) -> Tensor:
        """One-hot rows of the k selected experts, (K, n) or (T, K, n) (long)."""
        return F.one_hot(self.selection(), self.num_experts)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k={self.k}, noisy={self.noisy}"
