"""A sparse mixture-of-experts feed-forward block for transformers: per-token routing.

:class:`SparseMoEFeedForward` replaces a transformer's feed-forward layer: each token ``x_t``
(any leading dims, e.g. ``(B, S, d_model)``) is routed by a per-example gate (any registered
gate, DSelect-k included) to at most ``k`` experts, each a two-layer MLP
``d_model -> d_ff -> d_model`` (or, with ``gated=True``, a gated unit
``down(act(x W_g) ⊙ x W_u)``: SwiGLU with ``activation="silu"``, the experts of Mixtral, Qwen-MoE
and OLMoE, whose weights :meth:`SparseMoEFeedForward.from_hf_block` loads), and the output is
``Σ_i w_ti E_i(x_t)`` over the experts the token was dispatched to.

Dispatch (the sparse path; no expert is ever evaluated on a token not routed to it): the
(token, expert) pairs are sorted by expert, the tokens are gathered once in that order, each
layer is one grouped matmul (:func:`~dselectk.layers.experts.grouped_linear`: one matmul per
used expert on its block of rows, forward and backward written into shared buffers), and the
weighted results are scatter-added back to their tokens. :meth:`SparseMoEFeedForward.reference`
computes the same output the slow way (every expert on every token, masked), differentiably:
the tests' oracle.

Which experts a token goes to: those with a nonzero weight, at most ``k`` of them (the largest). For
gates with at most ``k`` nonzeros per token (Top-k; DSelect-k once its bits S(Wx) are binary) the
block computes the gate's mixture exactly. For gates whose weights can have more nonzeros (DSelect-k
while S(Wx) is not binary, softmax), the weight outside the ``k`` largest is dropped (or, with
``renormalize=True``, the default, the kept weights are rescaled to sum to 1), so the compute stays
at ``k`` experts per token. Measured per token (``research/notes/per_token.md``, a character-level
LM): DSelect-k with λ = 0 (its default ``entropy_reg``) and ``renormalize=True`` matched Top-k's
bits per byte on 9 reserved seeds, its bits mostly soft (the top-k cut picks the experts); the
paper's λ > 0 drives the bits binary and was worse there. With k selectors some tokens end with both
on one code and get one expert; one selector more than ``k`` (``selectors=3`` with ``k=2``, the
defaults) kept 1.98 distinct experts a token, +0.0006 ± 0.0070 bits per byte from Top-k over 27
reserved seeds. For a gate that ends exactly sparse, train soft and binarize late:
``DSelectK(distinct=True)`` with λ = 0 for the first half of the steps, then ramped to 0.1 (e.g.
``dselectk.variants.Ramp("entropy_reg", end=0.1, delay=0.5, before=0.0)``); on 9 fresh seeds it left
83 % of the tokens binary with 2 distinct experts each, 0.006 ± 0.006 bits per byte behind Top-k.

Capacity (optional, as Switch Transformer / GShard): with ``capacity_factor=c`` each expert takes
at most ``ceil(c · N · k / n)`` (token, expert) pairs of a batch of N tokens; pairs over capacity
are dropped (their term is missing from the token's output, which in a residual block leaves
the token unchanged by that expert). Priority goes to first choices: all pairs of rank 1 (the
token's largest weight) in token order, then rank 2, and so on (GShard's rule). Dropped pairs
are counted in :attr:`SparseMoEFeedForward.last_stats`. ``None`` (default): no capacity limit.

Expert choice (``routing="expert"``; Zhou et al., *Mixture-of-Experts with Expert Choice
Routing*, NeurIPS 2022): the experts choose instead of the tokens. Each expert takes the
``C = ceil(c · N · k / n)`` tokens of the batch with the largest gate weight for it (c: the
capacity factor, 1 if None; at most N), so every expert is exactly full and a token may go to
none, one or many experts; the pair weight is the gate's weight (use a gate whose weights are
probabilities over experts, e.g. ``"softmax"``). Note: which experts a token reaches depends on
the other tokens of the batch, future ones included, so in a causal language model expert choice
sees the batch (the paper's caveat for autoregressive decoding); its outputs are not those of a
per-token gate.

Load balancing (Switch Transformer, Fedus et al. 2021, eq. 4), for every gate:
``balance = n · Σ_i f_i · P_i`` where f_i is the fraction of the (token, expert) pairs routed to
expert i (before capacity drops; the f sum to 1, so balanced routing gives 1) and P_i the mean
over tokens of the gate's probability for i. A gate's weights need not be probabilities (they
may sum to less than 1, e.g. DSelect-k with n not a power of two), so P uses the weights
normalised per token, ``w_ti / Σ_j w_tj``. For DSelect-k these are its full weights (gradient
reaches every selector and bit), for Top-k the softmax over its top k. f is not differentiable,
P is. The block's auxiliary loss is the gate's own (e.g. DSelect-k's entropy term, averaged over
tokens) plus ``balance_weight · balance``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from dselectk._validate import check_choice, check_flag, check_number
from dselectk.gates.base import Gate, check_nonnegative, check_positive_int
from dselectk.gates.registry import GATES, make_gate
from dselectk.layers.experts import GatedMLP, StackedMLP

__all__ = ["Routing", "SparseMoEFeedForward", "TokenMoEOutput", "balance_loss"]


class TokenMoEOutput(NamedTuple):
    """What :class:`SparseMoEFeedForward` returns.

    Examples:
        >>> from dselectk import SparseMoEFeedForward
        >>> layer = SparseMoEFeedForward(8, 16, num_experts=4)  # d_model 8, d_ff 16
        >>> output, aux_loss = layer(torch.randn(4, 6, 8))  # (batch, seq, d_model)
        >>> tuple(output.shape), aux_loss.dim()
        ((4, 6, 8), 0)
    """

    output: Tensor
    """(..., d_model), shaped like the input."""
    aux_loss: Tensor
    """Scalar: the gate's auxiliary loss + balance_weight · balance loss."""


class Routing(NamedTuple):
    """The routing of a batch of N tokens (see :meth:`SparseMoEFeedForward.route`).

    Examples:
        >>> from dselectk import SparseMoEFeedForward
        >>> layer = SparseMoEFeedForward(16, 32, num_experts=4, gate="topk", k=2)
        >>> r = layer.route(torch.randn(12, 16))  # 12 tokens, 2 experts each
        >>> tuple(r.weights.shape), tuple(r.token.shape), sum(r.counts), r.dropped
        ((12, 4), (24,), 24, 0)
    """

    weights: Tensor
    """(N, n) the gate's weights (all of them, before the top-k cut)."""
    gate_aux: Tensor
    """Scalar auxiliary loss of the gate."""
    token: Tensor
    """(P,) token index of each dispatched (token, expert) pair, sorted by expert."""
    expert: Tensor
    """(P,) expert of each pair (non-decreasing)."""
    pair_weight: Tensor
    """(P,) weight of each pair (differentiable)."""
    counts: list[int]
    """Pairs per expert after capacity (n entries; sum P)."""
    routed: Tensor
    """(n,) pairs per expert before capacity (what the balance loss's f counts)."""
    dropped: int
    """Pairs dropped by the capacity limit."""


def _hf_activation(fn: Any) -> str:
    """Our name of a transformers activation module (``ACT2FN[...]``)."""
    name = type(fn).__name__.lower()
    for ours, theirs in (("silu", "silu"), ("silu", "swish"), ("relu", "relu"), ("tanh", "tanh")):
        if name.startswith(theirs):
            return ours
    if name in ("geluactivation", "gelu") and getattr(fn, "approximate", "none") == "none":
        return "gelu"
    raise ValueError(f"block: the experts' activation {type(fn).__name__} is not supported")


class _Combine(torch.autograd.Function):
    """``out[t] = Σ_{pairs p of token t} w_p · y_p`` for (P, d) expert outputs ``y``: the
    weighting and the scatter-add in one node. Backward gathers the output gradient once and
    reuses that buffer for the gradient of ``y`` (scaled in place)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, y: Tensor, weight: Tensor, token: Tensor, num_tokens: int
    ) -> Tensor:
        ctx.save_for_backward(y, weight, token)
        out = y.new_zeros(num_tokens, y.shape[1])
        return out.index_add_(0, token, y * weight.unsqueeze(1))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        y, weight, token = ctx.saved_tensors
        g = grad.index_select(0, token)  # (P, d)
        g_weight = (g * y).sum(1) if ctx.needs_input_grad[1] else None
        g_y = g.mul_(weight.unsqueeze(1)) if ctx.needs_input_grad[0] else None
        return g_y, g_weight, None, None


def balance_loss(weights: Tensor, routed: Tensor) -> Tensor:
    """Switch-style load-balancing loss ``n · Σ_i f_i · P_i`` (see the module docstring).

    Args:
        weights: (N, n) gate weights, any nonnegative numbers (normalised per token here).
        routed: (n,) number of (token, expert) pairs routed to each expert.

    An empty batch (N = 0) gives 0, connected to ``weights`` (its gradient is 0).

    Examples:
        >>> float(balance_loss(torch.full((6, 4), 0.25), torch.tensor([3, 3, 3, 3])))  # balanced
        1.0
        >>> one_expert = torch.tensor([[1.0, 0.0, 0.0, 0.0]]).expand(6, 4)
        >>> float(balance_loss(one_expert, torch.tensor([6, 0, 0, 0])))  # collapsed: n
        4.0
    """
    n = weights.shape[-1]
    probs = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    p = probs.sum(0) / max(probs.shape[0], 1)  # an empty batch: 0 (with gradients), not NaN
    f = routed.to(weights.dtype) / routed.sum().clamp_min(1).to(weights.dtype)
    return n * (f * p).sum()


#: keyword arguments of earlier versions and what replaced them (a TypeError names the new one)
_RENAMED = {
    "router": "gate= (the per-token gate: a gate name or a Gate)",
    "router_kwargs": "gate_kwargs= (DSelect-k's selector count is selectors=)",
    "balance_loss_weight": "balance_weight=",
}


def selector_count(gate: str, k: int, selectors: int | None) -> int:
    """The ``k`` argument a gate named ``gate`` is built with: for ``"topk"`` the experts per
    token ``k``; for selector gates (DSelect-k, COMET, the ablations) ``selectors`` (None: k).

    >>> selector_count("dselect_k", 2, 3), selector_count("topk", 2, 3)
    (3, 2)
    """
    if gate == "topk" or selectors is None:
        return k
    return selectors


class SparseMoEFeedForward(nn.Module):
    """Sparse MoE feed-forward block with a pluggable per-token gate (module docstring).

    Args:
        d_model: token size.
        d_ff: hidden size of each expert.
        num_experts: n >= 2.
        gate: the per-token gate: a gate name of :func:`~dselectk.gates.make_gate` (built
            per-example with ``in_features=d_model``; ``"topk"`` with ``k``, selector gates
            with ``selectors``) or a per-example single :class:`~dselectk.gates.Gate` with
            ``in_features=d_model`` and n experts.
        k: the experts each token is sent to (at most; the largest weights).
        selectors: the selector count of DSelect-k (and the other selector gates: COMET, the
            ablations) when ``gate`` is a name; None: ``k``. Default 3: one more than the
            default ``k`` kept 2 distinct experts a token (module docstring). Not used by
            ``"topk"`` or a Gate instance.
        capacity_factor: None (no limit) or c > 0: each expert takes at most
            ``ceil(c · N · k / n)`` pairs of a batch of N tokens.
        balance_weight: weight of the Switch balance loss in ``aux_loss`` (0: not computed).
        renormalize: rescale the kept weights of a token to sum to 1 when the top-k cut drops
            some (token routing only). None (default): True for token routing, False for
            expert choice.
        routing: "token" (each token picks its k experts) or "expert" (expert choice: each
            expert picks its ``C = ceil(c · N · k / n)`` tokens; module docstring).
        activation: the experts' hidden activation ("gelu", "relu", "silu", ...); with
            ``gated=True`` the activation of the gate projection.
        gated: gated experts (:class:`~dselectk.layers.GatedMLP`, no biases):
            ``down(act(x W_g) ⊙ x W_u)`` with hidden size ``d_ff``; SwiGLU with
            ``activation="silu"``. False (default): two-layer MLPs with biases
            (:class:`~dselectk.layers.StackedMLP`).
        gate_kwargs: extra arguments of the gate when ``gate`` is a name (gamma,
            entropy_reg, ...). DSelect-k's default ``entropy_reg`` is 0 (λ = 0, measured
            best per token).

    The defaults are the measured per-token recommendation: DSelect-k with λ = 0, three
    selectors, top-2 dispatch, renormalised, balance weight 0.01.

    Example::

        >>> import torch
        >>> from dselectk import SparseMoEFeedForward
        >>> layer = SparseMoEFeedForward(16, 32, num_experts=8)  # DSelect-k, 3 selectors, top-2
        >>> out = layer(torch.randn(4, 10, 16))
        >>> out.output.shape, out.aux_loss.dim()
        (torch.Size([4, 10, 16]), 0)
    """

    gate: Gate
    """The per-token gate (the ``gate`` argument, built). State-dict keys ``gate.*``; a state
    saved with the earlier attribute name (``router.*``) loads as well."""

    last_stats: dict[str, Any] | None
    """Routing statistics of the last forward (detached): ``load`` (n,) pairs per expert after
    capacity, ``routed`` (n,) before, ``dropped``, ``tokens``."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        gate: Gate | str = "dselect_k",
        k: int = 2,
        *,
        selectors: int | None = 3,
        capacity_factor: float | None = None,
        balance_weight: float = 0.01,
        renormalize: bool | None = None,
        activation: str = "gelu",
        gate_kwargs: dict[str, Any] | None = None,
        routing: str = "token",
        gated: bool = False,
        **renamed: Any,
    ) -> None:
        super().__init__()
        for key in renamed:
            if key in _RENAMED:
                raise TypeError(f"SparseMoEFeedForward: {key}= is now {_RENAMED[key]}")
            raise TypeError(f"SparseMoEFeedForward got an unexpected keyword argument {key!r}")
        check_choice("routing", routing, ("token", "expert"))
        check_flag("renormalize", renormalize, allow_none=True)
        check_flag("gated", gated)
        check_positive_int("d_ff", d_ff)
        if capacity_factor is not None:
            check_number("capacity_factor", capacity_factor, minimum=0.0, open_min=True)
        uses_selectors = isinstance(gate, str) and gate != "topk" and gate in GATES
        uses_selectors = uses_selectors and GATES[gate].takes_k
        if selectors is not None and selectors != 3 and not uses_selectors:  # 3: the default
            named = gate if isinstance(gate, str) else type(gate).__name__
            raise ValueError(
                f"selectors={selectors} applies to the selector gates built by name (DSelect-k, "
                f"COMET, the ablations); gate {named!r} does not use it (Top-k sends each token "
                "to k experts: set k)"
            )
        if gate_kwargs is not None and not isinstance(gate_kwargs, dict):
            raise TypeError(f"gate_kwargs must be a dict or None, got {type(gate_kwargs).__name__}")
        if routing == "expert" and renormalize:
            raise ValueError("renormalize applies to token routing only (routing='token')")
        if renormalize is None:
            renormalize = routing == "token"
        self.routing = routing
        self.d_model = check_positive_int("d_model", d_model)
        self.num_experts = check_positive_int("num_experts", num_experts, 2)
        self.k = check_positive_int("k", k)
        if k > num_experts:
            raise ValueError(f"k must be <= num_experts ({num_experts}), got {k}")
        if selectors is not None:
            check_positive_int("selectors", selectors)
        if capacity_factor is not None and not (
            capacity_factor > 0 and math.isfinite(capacity_factor)
        ):
            raise ValueError(f"capacity_factor must be None or > 0, got {capacity_factor}")
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.balance_weight = check_nonnegative("balance_weight", balance_weight)
        self.renormalize = bool(renormalize)
        if isinstance(gate, str):
            kw = dict(gate_kwargs or {})
            if "k" in kw:
                raise TypeError(
                    "gate_kwargs: the gate's k is set by k= (Top-k) or selectors= (DSelect-k "
                    "and other selector gates); do not pass it in gate_kwargs"
                )
            if gate in GATES and GATES[gate].takes_k:
                kw["k"] = selector_count(gate, k, selectors)
            gate = make_gate(gate, num_experts, in_features=d_model, **kw)
        elif gate_kwargs:
            raise ValueError("gate_kwargs only apply when gate is a gate name")
        if not isinstance(gate, Gate):
            raise TypeError(f"gate must be a Gate or a gate name, got {type(gate).__name__}")
        if gate.static or gate.in_features != d_model or gate.num_gates is not None:
            raise ValueError(
                f"gate must be a per-example single gate with in_features={d_model}, got {gate!r}"
            )
        if gate.num_experts != num_experts:
            raise ValueError(f"gate has {gate.num_experts} experts, expected {num_experts}")
        self.gate = gate
        self.gated = bool(gated)
        self.experts: StackedMLP | GatedMLP
        if self.gated:
            self.experts = GatedMLP(num_experts, d_model, d_ff, activation=activation)
        else:
            self.experts = StackedMLP(
                num_experts, d_model, [d_ff, d_model], activation=activation, final_activation=False
            )
        self.last_stats = None

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # A state saved when the gate was the attribute ``router`` (keys ``router.*``) loads:
        # its keys are renamed in place (torch hands each child the keys of this dict after
        # this call), unless the state also holds ``gate.*`` keys.
        old, new = prefix + "router.", prefix + "gate."
        if not any(key.startswith(new) for key in state_dict):
            for key in [key for key in state_dict if key.startswith(old)]:
                state_dict[new + key[len(old) :]] = state_dict.pop(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def __getattr__(self, name: str) -> Any:
        if name == "router":
            raise AttributeError(f"{type(self).__name__}.router is now .gate")
        return super().__getattr__(name)

    @classmethod
    def from_hf_block(cls, block: nn.Module, **kwargs: Any) -> SparseMoEFeedForward:
        """A gated block holding the experts and router of a Hugging Face sparse MoE block.

        For blocks built like transformers' ``MixtralSparseMoeBlock`` (``OlmoeSparseMoeBlock``,
        ``Qwen2MoeSparseMoeBlock``, ...): ``block.gate`` a top-k router with a
        ``(num_experts, hidden)`` ``weight`` and ``top_k``, and ``block.experts`` with fused
        ``gate_up_proj`` (E, 2·intermediate, hidden) and ``down_proj`` (E, hidden,
        intermediate) and ``act_fn``. The router becomes a bias-free ``"topk"`` gate (softmax
        over the k largest logits: Mixtral, and Qwen-MoE / OLMoE with ``norm_topk_prob``) or,
        when the router does not renormalise its top k (``norm_topk_prob=False``), a bias-free
        ``"softmax"`` gate cut to its k largest weights, which is exactly that routing. The
        result computes the block's output up to rounding (and the order of ties). Not
        hosted: a shared expert (Qwen-MoE's ``shared_expert`` and its gate; add it yourself)
        and router jitter noise in training.

        Args:
            block: the Hugging Face block (transformers is not imported here).
            **kwargs: other arguments of the constructor (``balance_weight``,
                ``capacity_factor``, ...).
        """
        gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
        weight = getattr(gate, "weight", None)
        gate_up = getattr(experts, "gate_up_proj", None)
        down = getattr(experts, "down_proj", None)
        top_k = getattr(gate, "top_k", None)
        if not (
            isinstance(weight, Tensor)
            and weight.dim() == 2
            and isinstance(gate_up, Tensor)
            and gate_up.dim() == 3
            and isinstance(down, Tensor)
            and down.dim() == 3
            and isinstance(top_k, int)
        ):
            raise TypeError(
                "block must have gate.weight (E, hidden), gate.top_k, experts.gate_up_proj "
                f"(E, 2*intermediate, hidden) and experts.down_proj, got {type(block).__name__}"
            )
        if getattr(gate, "bias", None) is not None:
            raise ValueError("block: routers with a bias are not hosted (gate.bias is set)")
        act = _hf_activation(getattr(experts, "act_fn", None))
        n, d_model = weight.shape
        d_ff = gate_up.shape[1] // 2
        renorm = bool(getattr(gate, "norm_topk_prob", True))
        for key in ("gate", "k", "gated", "activation", "gate_kwargs", "renormalize", "selectors"):
            if key in kwargs:
                raise ValueError(f"{key} is taken from the block; do not pass it")
        layer = cls(
            d_model,
            d_ff,
            n,
            "topk" if renorm else "softmax",
            top_k,
            gated=True,
            activation=act,
            renormalize=False,
            gate_kwargs={"bias": False},
            **kwargs,
        ).to(dtype=gate_up.dtype, device=gate_up.device)
        with torch.no_grad():
            proj = layer.gate.proj
            assert proj is not None
            proj.weight.copy_(weight)
        assert isinstance(layer.experts, GatedMLP)
        layer.experts.load_fused(gate_up.detach(), down.detach())
        return layer

    def capacity(self, num_tokens: int) -> int | None:
        """Pairs each expert takes from a batch of ``num_tokens`` tokens (None: no limit; expert
        choice: the tokens each expert takes, at most ``num_tokens``)."""
        factor = self.capacity_factor
        if factor is None:
            if self.routing == "token":
                return None
            factor = 1.0
        cap = max(1, math.ceil(factor * num_tokens * self.k / self.num_experts))
        return min(cap, num_tokens) if self.routing == "expert" else cap

    def _expert_choice(self, weights: Tensor, gate_aux: Tensor) -> Routing:
        """Every expert takes the ``capacity`` tokens with its largest weights (zero weights
        dispatch nothing); pairs come sorted by expert, then by weight."""
        big_n, n = weights.shape
        cap = self.capacity(big_n)
        assert cap is not None
        top_w, top_t = weights.t().topk(cap, dim=-1)  # (n, C)
        flat_w, flat_t = top_w.reshape(-1), top_t.reshape(-1)
        flat_e = torch.arange(n, device=weights.device).repeat_interleave(cap)
        live = (flat_w > 0).nonzero().squeeze(1)
        flat_w, flat_e, flat_t = flat_w[live], flat_e[live], flat_t[live]
        routed = torch.bincount(flat_e, minlength=n)
        return Routing(weights, gate_aux, flat_t, flat_e, flat_w, routed.tolist(), routed, 0)

    def route(self, x: Tensor) -> Routing:
        """Gate the (N, d_model) tokens and build the dispatch (sorted by expert)."""
        out = self.gate(x)
        weights = out.weights  # (N, n)
        if self.routing == "expert":
            return self._expert_choice(weights, out.aux_loss)
        n, big_n = self.num_experts, weights.shape[0]
        k = min(self.k, n)
        top_w, top_e = weights.topk(k, dim=-1)  # (N, k), largest first: rank-major priority
        if self.renormalize:
            top_w = top_w / top_w.sum(-1, keepdim=True).clamp_min(torch.finfo(top_w.dtype).tiny)
        # Pairs in rank-major order (all first choices, then second, ...), then by token:
        # pair i is token i mod N's choice of rank i // N.
        flat_w = top_w.t().reshape(-1)
        live = (flat_w > 0).nonzero().squeeze(1)  # zero weights dispatch nothing
        live_e = top_e.t().reshape(-1)[live]
        routed = torch.bincount(live_e, minlength=n)
        order = torch.sort(live_e, stable=True)  # by expert; priority kept within
        pair = live[order.indices]
        flat_w, flat_e, flat_t = flat_w[pair], order.values, pair.remainder(big_n)
        cap = self.capacity(big_n)
        dropped = 0
        if cap is not None:
            starts = torch.cumsum(routed, 0) - routed
            pos = torch.arange(flat_e.numel(), device=x.device) - starts[flat_e]
            keep = (pos < cap).nonzero().squeeze(1)
            dropped = int(flat_e.numel() - keep.numel())
            flat_w, flat_e, flat_t = flat_w[keep], flat_e[keep], flat_t[keep]
            counts = routed.clamp(max=cap).tolist()
        else:
            counts = routed.tolist()
        return Routing(weights, out.aux_loss, flat_t, flat_e, flat_w, counts, routed, dropped)

    def forward(self, x: Tensor) -> TokenMoEOutput:
        """Route every token of ``x`` (..., d_model); returns the output and the aux loss."""
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (..., {self.d_model}), got {tuple(x.shape)}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.d_model)
        r = self.route(flat)
        # (P, d): one gather, one grouped matmul per layer
        y = self.experts.forward_grouped(flat.index_select(0, r.token), r.counts)
        pair_weight = r.pair_weight.to(y.dtype)
        if torch.is_grad_enabled() and (y.requires_grad or pair_weight.requires_grad):
            out = _Combine.apply(y, pair_weight, r.token, flat.shape[0])
        else:  # the same sums without an autograd node
            out = y.new_zeros(flat.shape[0], y.shape[1])
            out.index_add_(0, r.token, y * pair_weight.unsqueeze(1))
        # A token whose gate weights are not finite (a NaN input) is routed to no expert;
        # its output must say so (NaN), not read as a valid zero. On the CPU a check (no
        # pass over the output when every token is fine); elsewhere one masked add, no sync.
        if out.device.type != "cpu":
            bad = ~torch.isfinite(r.weights).all(-1, keepdim=True)
            out = out + torch.where(bad, torch.nan, 0.0).to(out.dtype)
        elif not bool(torch.isfinite(r.weights).all()):
            out = out.masked_fill(~torch.isfinite(r.weights).all(-1, keepdim=True), torch.nan)
        aux = r.gate_aux
        if self.balance_weight > 0:
            aux = aux + self.balance_weight * balance_loss(r.weights, r.routed)
        self.last_stats = {
            "load": torch.tensor(r.counts),
            "routed": r.routed.detach().cpu(),
            "dropped": r.dropped,
            "tokens": int(flat.shape[0]),
        }
        return TokenMoEOutput(out.reshape(*lead, self.d_model), aux)

    @torch.no_grad()
    def dense_reference(self, x: Tensor) -> Tensor:
        """``Σ_i w_i E_i(x)`` with every expert evaluated on every token (tests, debugging)."""
        flat = x.reshape(-1, self.d_model)
        w = self.gate(flat).weights  # (N, n)
        every = self.experts(flat)  # (n, N, d)
        return torch.einsum("tn,ntd->td", w, every).reshape(x.shape)

    def reference(self, x: Tensor) -> Tensor:
        """The output of :meth:`forward` computed densely: every expert on every token, each
        token's outputs mixed with its dispatched pair weights (0 for experts it does not go
        to). Differentiable (the same routing, so the same gradients up to rounding); costs
        ``num_experts / k`` times the sparse path's expert FLOPs. For tests and debugging."""
        flat = x.reshape(-1, self.d_model)
        r = self.route(flat)
        mix = flat.new_zeros(flat.shape[0], self.num_experts)
        mix = mix.index_put((r.token, r.expert), r.pair_weight.to(mix.dtype), accumulate=True)
        every = self.experts(flat)  # (n, N, d)
        out = torch.einsum("tn,ntd->td", mix, every)
        bad = ~torch.isfinite(r.weights).all(-1, keepdim=True)
        out = out + torch.where(bad, torch.nan, 0.0).to(out.dtype)
        return out.reshape(x.shape)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_experts={self.num_experts}, k={self.k}, "
            f"capacity_factor={self.capacity_factor}, "
            f"balance_weight={self.balance_weight:g}, renormalize={self.renormalize}"
            + (", routing='expert'" if self.routing == "expert" else "")
            + (", gated=True" if self.gated else "")
        )
