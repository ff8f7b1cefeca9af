"""Expert banks: E experts evaluated together."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dselectk._validate import check_flag, check_input_like, check_number, check_sizes
from dselectk.gates.base import check_positive_int

__all__ = ["ExpertList", "GatedMLP", "StackedMLP", "grouped_linear", "make_towers"]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "tanh": torch.tanh,
    "identity": lambda t: t,
}


def _check_counts(x: Tensor, weight: Tensor, counts: Sequence[int]) -> tuple[int, ...]:
    if len(counts) != weight.shape[0]:
        raise ValueError(f"counts must have {weight.shape[0]} entries, got {len(counts)}")
    cs = tuple(int(c) for c in counts)
    if any(c < 0 for c in cs):
        raise ValueError(f"counts must be >= 0, got {list(cs)}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[0] != sum(cs):
        raise ValueError(
            f"x must be (sum(counts)={sum(cs)}, {weight.shape[1]}), got {tuple(x.shape)}"
        )
    return cs


def _grouped_products(
    x: Tensor, weight: Tensor, bias: Tensor | None, counts: Sequence[int]
) -> Tensor:
    """``x[rows of e] @ weight[e] (+ bias[e])`` for each member, into one (N, b) buffer."""
    out = x.new_empty(x.shape[0], weight.shape[2])
    start = 0
    for e, c in enumerate(counts):
        if c:
            blk = slice(start, start + c)
            if bias is None:
                torch.mm(x[blk], weight[e], out=out[blk])
            else:
                torch.addmm(bias[e], x[blk], weight[e], out=out[blk])
            start += c
    return out


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ weight[e] (+ bias[e])`` for consecutive row blocks.

    Forward and backward write every member's matmul straight into one preallocated buffer
    (``out=`` of a row block, or of ``grad_weight[e]``): no per-member temporaries, no
    concatenation, and one backward node for the whole layer. Written with autograd's own
    ``split``/``cat``/``unbind`` the same matmuls cost up to a third more on the CPU (their
    backward nodes allocate and add zero tensors of the whole weight or of all rows).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, counts: tuple[int, ...]
    ) -> Tensor:
        out = _grouped_products(x, weight, bias, counts)
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        grad = grad.contiguous()
        gx = torch.empty_like(x) if need_x else None
        gw = torch.empty_like(weight) if need_w else None
        gb = weight.new_empty(weight.shape[0], weight.shape[2]) if need_b else None
        start = 0
        for e, c in enumerate(ctx.counts):
            if not c:  # a member without rows gets a zero gradient
                if gw is not None:
                    gw[e].zero_()
                if gb is not None:
                    gb[e].zero_()
                continue
            blk = slice(start, start + c)
            g = grad[blk]
            if gx is not None:
                torch.mm(g, weight[e].t(), out=gx[blk])
            if gw is not None:
                torch.mm(x[blk].t(), g, out=gw[e])
            if gb is not None:
                torch.sum(g, 0, out=gb[e])
            start += c
        return gx, gw, gb, None


def grouped_linear(x: Tensor, weight: Tensor, bias: Tensor | None, counts: Sequence[int]) -> Tensor:
    """One linear layer per member on consecutive row blocks: a grouped matmul.

    Args:
        x: (N, a) rows grouped by member: the first ``counts[0]`` rows go through member 0, the
            next ``counts[1]`` through member 1, and so on.
        weight: (E, a, b) one (a, b) matrix per member (``x @ weight[e]``).
        bias: (E, b) or None.
        counts: E nonnegative row counts summing to N (0 skips a member).

    Returns:
        (N, b). Differentiable in ``x``, ``weight`` and ``bias``; members without rows get zero
        gradients. One matmul per used member forward, at most two (and a column sum) backward,
        each written into its block of one buffer.

    Examples:
        Rows 0-1 go through member 0, rows 2-4 through member 1:

        >>> x, weight = torch.randn(5, 3), torch.randn(2, 3, 4)  # (N, a), (E, a, b)
        >>> y = grouped_linear(x, weight, None, [2, 3])
        >>> tuple(y.shape), torch.allclose(y[2:], x[2:] @ weight[1])
        ((5, 4), True)
    """
    cs = _check_counts(x, weight, counts)
    if bias is not None and bias.shape != (weight.shape[0], weight.shape[2]):
        raise ValueError(
            f"bias must be ({weight.shape[0]}, {weight.shape[2]}), got {tuple(bias.shape)}"
        )
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _GroupedLinear.apply(x, weight, bias, cs)
    return _grouped_products(x, weight, bias, cs)  # no autograd node to build


class StackedMLP(nn.Module):
    """E identical-shape MLPs with stacked weights, evaluated as batched matmuls.

    Used both as the experts of an MoE and as T task towers. Every layer is Dense + activation
    (+ dropout), except the last layer, which is linear unless ``final_activation=True``.

    Args:
        num_members: E, the number of MLPs.
        in_features: input size.
        layer_sizes: output size of each layer (e.g. ``[256]`` for the paper's MovieLens expert).
        activation: "relu", "gelu", "silu", "tanh" or "identity".
        dropout: dropout rate after each activated layer.
        final_activation: apply the activation (and dropout) after the last layer too.
            Default False: the last layer is linear, so task towers can predict any real value
            (a tower ending in ReLU predicts nothing below 0). The paper's experts end in their
            activation: pass True for them.

    Examples:
        >>> from dselectk.layers import StackedMLP
        >>> experts = StackedMLP(3, 16, [32, 8])  # 3 MLPs 16 -> 32 -> 8
        >>> tuple(experts(torch.randn(4, 16)).shape)  # (members, batch, out)
        (3, 4, 8)
        >>> tuple(experts(torch.randn(4, 16), torch.tensor([0, 2])).shape)  # members 0 and 2
        (2, 4, 8)
    """

    def __init__(
        self,
        num_members: int,
        in_features: int,
        layer_sizes: Sequence[int],
        *,
        activation: str = "relu",
        dropout: float = 0.0,
        final_activation: bool = False,
    ) -> None:
        super().__init__()
        layer_sizes = check_sizes("layer_sizes", layer_sizes)
        check_number("dropout", dropout, minimum=0.0, maximum=1.0, open_max=True)
        check_flag("final_activation", final_activation)
        self.num_members = check_positive_int("num_members", num_members)
        self.in_features = check_positive_int("in_features", in_features)
        if len(layer_sizes) == 0:
            raise ValueError("layer_sizes must name at least one layer")
        sizes = [check_positive_int("layer_sizes[i]", s) for s in layer_sizes]
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.activation = activation
        self.dropout = float(dropout)
        self.final_activation = bool(final_activation)
        self.out_features = sizes[-1]
        dims = [in_features, *sizes]  # consecutive pairs give each layer's shape
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(num_members, a, b)) for a, b in itertools.pairwise(dims)
        )
        self.biases = nn.ParameterList(nn.Parameter(torch.empty(num_members, b)) for b in sizes)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's default initialisation, member by member: U(±1/sqrt(fan_in))."""
        for w, b in zip(self.weights, self.biases):
            bound = 1.0 / math.sqrt(w.shape[1])
            w.uniform_(-bound, bound)
            b.uniform_(-bound, bound)

    def forward(self, x: Tensor, members: Tensor | None = None) -> Tensor:
        """Evaluate the MLPs.

        Args:
            x: (B, in) shared by all members, or (E', B, in) one input per member.
            members: optional (E',) indices: evaluate only these members (conditional
                computation; the others cost nothing, forward or backward).

        Returns:
            (E', B, out) with E' = E or len(members).
        """
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"x must have {self.in_features} features in its last dim, got {tuple(x.shape)}"
            )
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
        check_input_like(x, self.weights[0])
        act = _ACTIVATIONS[self.activation]
        last = len(self.weights) - 1
        h = x
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            if members is not None:
                w, b = w[members], b[members]
            # (B, a) @ (E, a, b) broadcasts to (E, B, b): one batched matmul for all members.
            h = torch.baddbmm(b.unsqueeze(1), h.expand(w.shape[0], *h.shape[-2:]), w)
            if i < last or self.final_activation:
                h = act(h)
                if self.dropout > 0:
                    h = F.dropout(h, self.dropout, self.training)
        return h

    def forward_grouped(self, x: Tensor, counts: Sequence[int]) -> Tensor:
        """Evaluate each member on its own block of rows (per-example routing).

        Args:
            x: (N, in) rows grouped by member: the first ``counts[0]`` rows go through member
                0, the next ``counts[1]`` through member 1, and so on (sum(counts) = N).
            counts: rows per member (E entries; 0 skips a member entirely).

        Returns:
            (N, out): row i is member(i)'s output on x[i]. Without autograd, each member's
            matmul writes straight into its block of one preallocated buffer and the
            activation runs in place on the whole buffer: E matmuls and one pass per layer,
            no per-member temporaries. With autograd, each layer is one
            :func:`grouped_linear` (the same buffers, one backward node).
        """
        if len(counts) != self.num_members:
            raise ValueError(f"counts must have {self.num_members} entries, got {len(counts)}")
        if x.dim() != 2 or x.shape[-1] != self.in_features or x.shape[0] != sum(counts):
            raise ValueError(
                f"x must be (sum(counts)={sum(counts)}, {self.in_features}), got {tuple(x.shape)}"
            )
        act = _ACTIVATIONS[self.activation]
        last = len(self.weights) - 1
        tracked = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in self.parameters())
        )
        h = x
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = grouped_linear(h, w, b, counts) if tracked else _grouped_products(h, w, b, counts)
            if i < last or self.final_activation:
                if self.activation == "relu" and not tracked:
                    h.relu_()
                else:
                    h = act(h)
                if self.dropout > 0:
                    h = F.dropout(h, self.dropout, self.training)
        return h

    def extra_repr(self) -> str:
        sizes = [w.shape[2] for w in self.weights]
        return (
            f"num_members={self.num_members}, in_features={self.in_features}, "
            f"layer_sizes={sizes}, activation={self.activation!r}, dropout={self.dropout}"
        )


class GatedMLP(nn.Module):
    """E gated feed-forward experts with stacked weights: ``down(act(x W_g) ⊙ (x W_u))``.

    With ``activation="silu"`` this is SwiGLU (Shazeer, 2020), the expert of Mixtral, Qwen-MoE,
    OLMoE and most recent MoE language models; no biases, as there. The gate and up projections
    are stored as one matrix per member, ``gate_up`` (E, in, 2·hidden) whose first ``hidden``
    columns are the gate's, and ``down`` (E, hidden, out): two matmuls per member and layer
    pass, like a two-layer MLP. :meth:`load_fused` copies the weights of a Hugging Face block's
    experts (``gate_up_proj`` (E, 2·hidden, in), ``down_proj`` (E, out, hidden)).

    Args:
        num_members: E, the number of experts.
        in_features: input size.
        hidden_features: hidden size of each expert (Hugging Face's ``intermediate_size``).
        out_features: output size (default: ``in_features``).
        activation: the gate's activation ("silu": SwiGLU, "gelu": GeGLU, "relu", ...).

    Examples:
        >>> from dselectk.layers import GatedMLP
        >>> experts = GatedMLP(3, 16, 32)  # 3 SwiGLU experts 16 -> 32 -> 16
        >>> tuple(experts(torch.randn(4, 16)).shape)  # (members, batch, out)
        (3, 4, 16)
    """

    def __init__(
        self,
        num_members: int,
        in_features: int,
        hidden_features: int,
        out_features: int | None = None,
        *,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.num_members = check_positive_int("num_members", num_members)
        self.in_features = check_positive_int("in_features", in_features)
        self.hidden_features = check_positive_int("hidden_features", hidden_features)
        self.out_features = check_positive_int(
            "out_features", in_features if out_features is None else out_features
        )
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}"
            )
        self.activation = activation
        e, h = self.num_members, self.hidden_features
        self.gate_up = nn.Parameter(torch.empty(e, self.in_features, 2 * h))
        self.down = nn.Parameter(torch.empty(e, h, self.out_features))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's default initialisation of each matrix: U(±1/sqrt(fan_in))."""
        for w in (self.gate_up, self.down):
            bound = 1.0 / math.sqrt(w.shape[1])
            w.uniform_(-bound, bound)

    @torch.no_grad()
    def load_fused(self, gate_up_proj: Tensor, down_proj: Tensor) -> None:
        """Copy Hugging Face's fused expert weights (``MixtralExperts`` and alike).

        Args:
            gate_up_proj: (E, 2·hidden, in): rows ``[:hidden]`` the gate projection, rows
                ``[hidden:]`` the up projection, each as ``nn.Linear.weight`` (out, in).
            down_proj: (E, out, hidden).
        """
        e, h = self.num_members, self.hidden_features
        want_gu = (e, 2 * h, self.in_features)
        want_d = (e, self.out_features, h)
        if tuple(gate_up_proj.shape) != want_gu:
            raise ValueError(f"gate_up_proj must be {want_gu}, got {tuple(gate_up_proj.shape)}")
        if tuple(down_proj.shape) != want_d:
            raise ValueError(f"down_proj must be {want_d}, got {tuple(down_proj.shape)}")
        self.gate_up.copy_(gate_up_proj.transpose(1, 2))
        self.down.copy_(down_proj.transpose(1, 2))

    def _glu(self, h: Tensor) -> Tensor:
        gate, up = h.chunk(2, dim=-1)
        return _ACTIVATIONS[self.activation](gate) * up

    def forward(self, x: Tensor, members: Tensor | None = None) -> Tensor:
        """Evaluate the experts on every row.

        Args:
            x: (B, in) shared by all members, or (E', B, in) one input per member.
            members: optional (E',) indices: evaluate only these members.

        Returns:
            (E', B, out) with E' = E or len(members).
        """
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"x must have {self.in_features} features in its last dim, got {tuple(x.shape)}"
            )
        gu, down = self.gate_up, self.down
        if members is not None:
            gu, down = gu[members], down[members]
        h = torch.bmm(x.expand(gu.shape[0], *x.shape[-2:]), gu)
        return torch.bmm(self._glu(h), down)

    def forward_grouped(self, x: Tensor, counts: Sequence[int]) -> Tensor:
        """Evaluate each member on its own block of rows (see
        :meth:`StackedMLP.forward_grouped`): two :func:`grouped_linear` calls.

        Args:
            x: (N, in) rows grouped by member (``counts[e]`` consecutive rows for member e).
            counts: rows per member (E entries, summing to N).

        Returns:
            (N, out).
        """
        return grouped_linear(
            self._glu(grouped_linear(x, self.gate_up, None, counts)), self.down, None, counts
        )

    def extra_repr(self) -> str:
        return (
            f"num_members={self.num_members}, in_features={self.in_features}, "
            f"hidden_features={self.hidden_features}, out_features={self.out_features}, "
            f"activation={self.activation!r}"
        )


class ExpertList(nn.Module):
    """Arbitrary expert modules (e.g. CNNs), evaluated one after the other and stacked.

    Args:
        experts: E modules mapping the same input to outputs of the same shape.

    Examples:
        >>> from dselectk.layers import ExpertList
        >>> experts = ExpertList([nn.Linear(16, 8) for _ in range(3)])
        >>> tuple(experts(torch.randn(4, 16)).shape)  # (members, batch, out)
        (3, 4, 8)
        >>> tuple(experts(torch.randn(4, 16), torch.tensor([1])).shape)  # expert 1 only
        (1, 4, 8)
    """

    def __init__(self, experts: Sequence[nn.Module]) -> None:
        super().__init__()
        if len(experts) < 1:
            raise ValueError("experts must contain at least one module")
        self.members = nn.ModuleList(experts)
        self.num_members = len(self.members)

    def forward(self, x: Tensor, members: Tensor | None = None) -> Tensor:
        """(E', B, ...) outputs of all experts, or of ``members`` only."""
        idx = range(self.num_members) if members is None else members.tolist()
        return torch.stack([self.members[i](x) for i in idx])


def make_towers(num_tasks: int, in_features: int, sizes: Sequence[int]) -> StackedMLP:
    """T task towers (ReLU dense layers, last layer linear), one batched module.

    For regression targets of any sign (the last layer has no activation); e.g. a
    multi-class head ``sizes=(50, 50, 10)`` with the softmax folded into the cross-entropy.

    Examples:
        >>> from dselectk.layers import make_towers
        >>> towers = make_towers(2, 8, [16, 1])  # 2 tasks: 8 -> 16 -> 1, last layer linear
        >>> tuple(towers(torch.randn(4, 8)).shape)  # (tasks, batch, out)
        (2, 4, 1)
    """
    check_positive_int("num_tasks", num_tasks)
    return StackedMLP(
        num_tasks, in_features, list(check_sizes("sizes", sizes)), final_activation=False
    )
