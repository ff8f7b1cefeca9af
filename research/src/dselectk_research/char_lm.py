"""A byte-level causal transformer whose feed-forward layers are sparse mixture-of-experts
blocks (:class:`~dselectk.layers.SparseMoEFeedForward`), routed per token by any gate::

    from dselectk.gates import make_gate
    from dselectk_research.char_lm import CharMoETransformer

    model = CharMoETransformer(
        lambda: make_gate("dselect_k", 8, k=2, in_features=64), seq_len=64, d_model=64
    )
    logits, aux = model(bytes_batch)  # (B, L, 256), the routers' auxiliary losses

:meth:`CharMoETransformer.from_settings` builds the model from a mapping of settings (a
study's hyperparameters), and :func:`train_bytes_per_token` estimates the memory its training
step needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dselectk.gates.base import Gate
from dselectk.layers import SparseMoEFeedForward

__all__ = [
    "SHAPE",
    "VOCAB",
    "CharMoETransformer",
    "MoEBlock",
    "byte_windows",
    "evaluate",
    "random_windows",
    "train_bytes_per_token",
]

#: the settings :meth:`CharMoETransformer.from_settings` reads as constructor arguments
SHAPE = ("seq_len", "d_model", "heads", "layers", "d_ff", "k", "balance_loss_weight", "renormalize")

VOCAB = 256
"""Bytes: the model reads and predicts one byte at a time."""


class MoEBlock(nn.Module):
    """Pre-LayerNorm block: causal multi-head self-attention, then a sparse MoE feed-forward
    layer routed by the gate ``router()`` returns (called after the attention weights are made);
    ``forward`` returns (output, the layer's auxiliary loss)."""

    def __init__(
        self,
        router: Callable[[], Gate],
        d_model: int,
        heads: int,
        d_ff: int,
        k: int,
        balance_loss_weight: float,
        renormalize: bool = False,
        routing: str = "token",
        capacity_factor: float | None = None,
    ) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        gate = router()
        self.moe = SparseMoEFeedForward(
            d_model,
            d_ff,
            gate.num_experts,
            gate,
            k=k,
            balance_weight=balance_loss_weight,
            renormalize=renormalize,
            routing=routing,
            capacity_factor=capacity_factor,
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        out, aux = self.moe(self.ln2(x))
        return x + out, aux


class CharMoETransformer(nn.Module):
    """Byte-level causal transformer: byte embedding plus learned positions, ``layers``
    :class:`MoEBlock` blocks, a final LayerNorm and a linear read-out to the 256 bytes.

    Args:
        router: called once per block (after that block's attention weights are made, so one
            seed fixes every weight) for a per-example gate with ``in_features=d_model``.
        seq_len: the longest input.
        d_model: width; a multiple of ``heads``.
        heads: attention heads.
        layers: blocks.
        d_ff: hidden width of each expert.
        k: experts per token.
        balance_loss_weight: weight of each layer's Switch balance loss.
        renormalize: rescale a token's kept weights to sum to 1 when the top-k cut drops some
            (:class:`~dselectk.layers.SparseMoEFeedForward`).
        routing: "token" or "expert" (expert choice over the batch's tokens; see
            :class:`~dselectk.layers.SparseMoEFeedForward`).
        capacity_factor: None (default: no limit; expert choice: 1) or c > 0: each expert of
            a layer takes at most ``ceil(c · N · k / n)`` (token, expert) pairs of a batch of N
            tokens (:class:`~dselectk.layers.SparseMoEFeedForward`).
    """

    def __init__(
        self,
        router: Callable[[], Gate],
        *,
        seq_len: int,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 2,
        d_ff: int = 128,
        k: int = 2,
        balance_loss_weight: float = 0.01,
        renormalize: bool = False,
        routing: str = "token",
        capacity_factor: float | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("heads", heads), ("layers", layers)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.blocks = nn.ModuleList(
            MoEBlock(
                router,
                d_model,
                heads,
                d_ff,
                k,
                balance_loss_weight,
                renormalize,
                routing,
                capacity_factor,
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    @classmethod
    def from_settings(
        cls, gate: Callable[..., Gate], settings: Mapping[str, Any], routing: str = "token"
    ) -> CharMoETransformer:
        """The model of ``settings``: the constructor's arguments by name (:data:`SHAPE`),
        ``num_experts`` and an optional ``capacity_factor`` (other keys are ignored); every MoE
        layer is routed by ``gate(num_experts, k=k, in_features=d_model)``."""
        width = settings["d_model"]
        router = partial(gate, settings["num_experts"], k=settings["k"], in_features=width)
        shape = {name: settings[name] for name in SHAPE}
        cap = settings.get("capacity_factor")
        return cls(router, routing=routing, capacity_factor=cap, **shape)

    @property
    def moe_layers(self) -> list[SparseMoEFeedForward]:
        """The sparse MoE layer of each block, in order."""
        return [m for m in self.modules() if isinstance(m, SparseMoEFeedForward)]

    def router_parameters(self) -> list[nn.Parameter]:
        """The parameters of every MoE layer's router, layer after layer."""
        return [p for m in self.moe_layers for p in m.gate.parameters()]

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits (B, L, 256) of the next byte after each of the (B, L) bytes ``x``, and the
        summed auxiliary loss of the routers."""
        h = self.embed(x) + self.pos[: x.shape[1]]
        aux = h.new_zeros(())
        for blk in self.blocks:
            h, a = blk(h)
            aux = aux + a
        return self.head(self.ln_f(h)), aux

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Mean cross-entropy (nats) of the next bytes ``y`` (B, L) plus the routers' loss."""
        logits, aux = self(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) + aux


def train_bytes_per_token(settings: Mapping[str, Any]) -> float:
    """Memory a training step keeps per token (activations for the backward pass) of the model
    of ``settings`` (as :meth:`CharMoETransformer.from_settings` reads them), an upper
    estimate: measured 17.5 KB at the defaults (peak RSS growth of one step at batch 256 and
    1024), estimated 23.5 KB."""
    d, k, d_ff, heads = settings["d_model"], settings["k"], settings["d_ff"], settings["heads"]
    per_layer = 16 * d + 3 * k * d_ff + 3 * heads * settings["seq_len"]
    return 4.0 * (settings["layers"] * per_layer + 3 * 256)


def byte_windows(stream: Tensor, seq_len: int, limit: int | None = None) -> tuple[Tensor, Tensor]:
    """Non-overlapping windows of a byte stream (at most ``limit``): inputs (W, L) and their
    next-byte targets (W, L)."""
    w = (len(stream) - 1) // seq_len
    if limit is not None:
        w = min(w, limit)
    x = stream[: w * seq_len].view(w, seq_len)
    return x, stream[1 : w * seq_len + 1].view(w, seq_len)


def random_windows(
    stream: Tensor, seq_len: int, count: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """``count`` windows of ``seq_len`` bytes starting at random offsets of ``stream`` (drawn
    with ``generator``): inputs (count, L) and their next-byte targets (count, L)."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (count,), generator=generator)
    chunks = stream[starts.unsqueeze(1) + torch.arange(seq_len + 1)]
    return chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous()


@torch.no_grad()
def evaluate(model: CharMoETransformer, x: Tensor, y: Tensor, batch: int = 256) -> dict[str, Any]:
    """Bits per byte of the next-byte targets ``y`` (W, L) given the inputs ``x`` (W, L), and
    the routing over those tokens: ``load`` (per layer, the fraction of the dispatched
    (token, expert) pairs on each expert), ``load_max_over_mean`` (worst layer),
    ``experts_per_token`` (nonzero weights), ``dispatched_experts_per_token`` (distinct experts
    a token is sent to: nonzero weights among its ``k`` largest, at most ``k``) and, for routers
    that binarize (DSelect-k), the fraction of tokens whose bits are binary (overall and per
    layer; None otherwise); with a capacity limit also ``dropped_pairs_per_token`` (the
    (token, expert) pairs over capacity, per token and layer: the distinct experts a token
    reaches are ``dispatched_experts_per_token`` minus these)."""
    model.eval()
    layers = model.moe_layers
    n = int(layers[0].num_experts)
    loads = [torch.zeros(n) for _ in layers]
    binary = [0.0 for _ in layers]
    nonzero = dispatched = dropped = 0.0
    inputs: list[Tensor] = []
    hooks = [m.gate.register_forward_hook(lambda m, a, o: inputs.append(a[0])) for m in layers]
    total, tokens = 0.0, 0
    try:
        for i in range(0, len(x), batch):
            yb = y[i : i + batch]
            inputs.clear()
            logits, _ = model(x[i : i + batch])
            ce = F.cross_entropy(logits.reshape(-1, VOCAB), yb.reshape(-1), reduction="sum")
            total, tokens = total + float(ce), tokens + yb.numel()
            for j, moe in enumerate(layers):
                assert moe.last_stats is not None
                loads[j] += moe.last_stats["load"].float()
                dropped += float(moe.last_stats["dropped"])
                w = moe.gate(inputs[j]).weights
                nonzero += float((w > 0).sum())
                dispatched += float((w.topk(min(moe.k, n), -1).values > 0).sum())
                if moe.gate.binarizes:  # tokens whose bits are all 0 or 1
                    binary[j] += float(moe.gate.binary_entries(inputs[j]).all(-1).sum())
    finally:
        for h in hooks:
            h.remove()
    model.train()
    binarizes = bool(layers[0].gate.binarizes)
    fractions = [(ld / ld.sum()).tolist() for ld in loads]
    capped = any(m.routing == "token" and m.capacity_factor is not None for m in layers)
    extra = {"dropped_pairs_per_token": dropped / (tokens * len(loads))} if capped else {}
    return {
        "bits_per_byte": total / tokens / math.log(2),
        "load": fractions,
        "load_max_over_mean": max(max(f) * n for f in fractions),
        "experts_per_token": nonzero / (tokens * len(loads)),
        "dispatched_experts_per_token": dispatched / (tokens * len(loads)),
        "binary_token_fraction": sum(binary) / (tokens * len(loads)) if binarizes else None,
        "binary_token_fraction_per_layer": [b / tokens for b in binary] if binarizes else None,
    } | extra
