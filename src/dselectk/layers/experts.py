"""Expert banks: E experts evaluated together."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dselectk.gates.base import check_positive_int

__all__ = ["ExpertList", "StackedMLP", "make_towers"]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "tanh": torch.tanh,
    "identity": lambda t: t,
}


class StackedMLP(nn.Module):
    """E identical-shape MLPs with stacked weights, evaluated as batched matmuls.

    Used both as the experts of an MoE and as T task towers. Every layer is Dense + activation
    (+ dropout), except that ``final_activation=False`` leaves the last layer linear.

    Args:
        num_members: E, the number of MLPs.
        in_features: input size.
        layer_sizes: output size of each layer (e.g. ``[256]`` for the paper's MovieLens expert).
        activation: "relu", "gelu", "tanh" or "identity".
        dropout: dropout rate after each activated layer.
        final_activation: apply the activation (and dropout) after the last layer too.
    """

    def __init__(
        self,
        num_members: int,
        in_features: int,
        layer_sizes: Sequence[int],
        *,
        activation: str = "relu",
        dropout: float = 0.0,
        final_activation: bool = True,
    ) -> None:
        super().__init__()
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
            no per-member temporaries. With autograd, the blocks are concatenated instead.
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
            if tracked:
                parts, start = [], 0
                for member, c in enumerate(counts):
                    if c:
                        parts.append(torch.addmm(b[member], h[start : start + c], w[member]))
                    start += c
                # no rows at all: an empty block that still belongs to the graph
                h = torch.cat(parts) if parts else h @ w[0] + b[0]
            else:
                out = h.new_empty(h.shape[0], w.shape[2])
                start = 0
                for member, c in enumerate(counts):
                    if c:
                        blk = slice(start, start + c)
                        torch.addmm(b[member], h[blk], w[member], out=out[blk])
                    start += c
                h = out
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


class ExpertList(nn.Module):
    """Arbitrary expert modules (e.g. CNNs), evaluated one after the other and stacked.

    Args:
        experts: E modules mapping the same input to outputs of the same shape.
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
    """
    return StackedMLP(num_tasks, in_features, list(sizes), final_activation=False)
