"""Expert mixer: gate weights × expert outputs, running only the experts some gate uses.

:class:`ExpertMixer` wraps an expert bank (:class:`~dselectk.layers.StackedMLP`,
:class:`~dselectk.layers.ExpertList`, the research CNN bank) and turns
(T, E) static or (B, T, E) per-example gate weights into (T, B, D) mixtures Σ_i f_i(x) w_i.
Experts whose weight is exactly zero in every gate are skipped (conditional computation); at
inference, per-example weights route each example only to its experts
(:meth:`ExpertMixer.dispatch`). The models in :mod:`dselectk.models` are built on it.

Export safety: both kinds of skipping read the *values* of the weights to choose which experts
run, which a tracer (``torch.jit.trace``, ``torch.onnx.export``) would freeze into the graph as
constants (a graph valid only for the example batch) and which ``torch.export`` cannot trace.
While tracing or exporting (:func:`exporting`), the mixer therefore takes the dense masked mix
instead: every expert is computed and weighted by its gate weight, which is exactly zero where
the expert is unused, so the outputs equal the routed ones (up to the order of float
additions) for any input. A fixed selection (a static gate whose experts were chosen once and
for all) is exported as a static gather by freezing the model first
(:func:`dselectk.export.freeze`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dselectk._validate import check_flag
from dselectk.layers.experts import StackedMLP

__all__ = ["ExpertMixer", "active_experts", "exporting", "mix"]


def exporting() -> bool:
    """Whether the code runs under a tracer or exporter that records a graph for later inputs.

    True under ``torch.jit.trace`` / ``torch.jit.script`` (and so the TorchScript ONNX exporter,
    ``torch.onnx.export(..., dynamo=False)``), ``torch.onnx.export`` of either kind, and
    ``torch.export`` (which the dynamo ONNX exporter uses). Plain ``torch.compile`` is not
    included: it guards on the data-dependent values (graph breaks), so routing stays correct.

    Examples:
        >>> exporting()  # eager code
        False
    """
    if torch.jit.is_scripting():
        return True
    return bool(
        torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()
    )


def active_experts(weights: Tensor, num_experts: int) -> Tensor | None:
    """Indices of the experts some gate weight uses, or None when all are used.

    Always None while :func:`exporting` (the choice would depend on the example's values).

    Examples:
        >>> active_experts(torch.tensor([[0.0, 0.6, 0.4, 0.0], [0.0, 1.0, 0.0, 0.0]]), 4)
        tensor([1, 2])
        >>> active_experts(torch.full((2, 4), 0.25), 4) is None  # every expert used
        True
    """
    if exporting():
        return None
    used = (weights != 0).reshape(-1, num_experts).any(dim=0)
    if bool(used.all()):
        return None
    return used.nonzero().squeeze(-1)


def mix(expert_out: Tensor, weights: Tensor) -> Tensor:
    """Combine (E, B, D) expert outputs with (T, E) or (B, T, E) weights into (T, B, D).

    Examples:
        >>> expert_out = torch.randn(4, 8, 5)  # (experts, batch, out)
        >>> tuple(mix(expert_out, torch.full((2, 4), 0.25)).shape)  # static weights, 2 tasks
        (2, 8, 5)
        >>> tuple(mix(expert_out, torch.rand(8, 2, 4)).shape)  # per-example weights
        (2, 8, 5)
    """
    if weights.dim() == 2:  # static: one matmul for all tasks
        e, b, d = expert_out.shape
        if not exporting() and b == 0:  # an empty batch (the reshape below would be ambiguous)
            return expert_out.new_zeros(weights.shape[0], 0, d)
        return (weights @ expert_out.reshape(e, b * d)).view(-1, b, d)
    return torch.bmm(weights, expert_out.transpose(0, 1)).transpose(0, 1)  # (T, B, D)


class ExpertMixer(nn.Module):
    """Experts + gates → mixed expert outputs, with automatic conditional computation.

    Examples:
        >>> from dselectk.layers import ExpertMixer, StackedMLP
        >>> mixer = ExpertMixer(StackedMLP(4, 16, [8]), conditional=True)
        >>> weights = torch.tensor([[0.0, 0.5, 0.5, 0.0]])  # (tasks, experts): 2 used
        >>> tuple(mixer.mix(torch.randn(3, 16), weights).shape)  # only experts 1, 2 run
        (1, 3, 8)
    """

    def __init__(self, experts: nn.Module, conditional: bool) -> None:
        super().__init__()
        n = getattr(experts, "num_members", None)
        if not isinstance(n, int):
            raise TypeError(
                "experts must be an expert bank with a num_members attribute "
                "(dselectk.layers.StackedMLP or ExpertList)"
            )
        self.experts = experts
        self.num_experts = n
        self.conditional = bool(check_flag("conditional", conditional))

    def mix(self, x: Tensor, weights: Tensor) -> Tensor:
        """(T, B, D) mixtures. Experts no weight uses are skipped, forward and backward.

        Skipping is exact: an expert whose weight is exactly zero in every gate contributes
        nothing to the output, and DSelect-k and Top-k weights that are exactly zero have exactly
        zero gradients as well (S'(z) = 0 on binary bits; top-k masks).

        While tracing or exporting (:func:`exporting`) nothing is skipped: the dense masked mix
        of all experts, which is what the skipping computes, for every input.
        """
        if not self.conditional or exporting():
            return mix(self.experts(x), weights)
        if weights.dim() == 3 and not self.training:
            routed = self.dispatch(x, weights)
            if routed is not None:
                return routed
        active = active_experts(weights, self.num_experts)
        if active is None:
            return mix(self.experts(x), weights)
        return mix(self.experts(x, active), weights.index_select(-1, active))

    def dispatch(self, x: Tensor, weights: Tensor, max_fill: float = 0.5) -> Tensor | None:
        """Per-example routing: each example goes only to the experts with a nonzero weight.

        The rows are grouped by expert, each used expert runs once on its rows, and the weighted
        outputs are scattered back (exact up to the order of the float additions). Used by
        :meth:`mix` at inference (``eval()``) for per-example gates.

        Args:
            x: (B, ...) input of the experts.
            weights: (B, T, E) per-example weights.
            max_fill: route only when at most this fraction of the (example, expert) pairs is
                used; otherwise return None (the dense batched evaluation is cheaper).

        Returns:
            (T, B, D...) mixtures, or None when the weights are not sparse enough, and always
            None while :func:`exporting` (the grouping depends on the weights' values).
        """
        if exporting():
            return None
        b, t, e = weights.shape
        if b == 0:  # an empty batch: nothing to route (the batched path handles it)
            return None
        used = (weights != 0).any(dim=1)  # (B, E): expert needed by some task of the example
        counts = used.sum(dim=0)  # (E,)
        per_expert = counts.tolist()  # one sync
        pairs = sum(per_expert)
        if pairs > max_fill * b * e:
            return None
        order = used.t().nonzero()  # (pairs, 2) = (expert, row), sorted by expert then row
        active = [i for i, c in enumerate(per_expert) if c > 0]
        cap = max(per_expert)
        # One padded batched call saves kernel launches on accelerators. On the CPU, stacked
        # experts run one matmul per used expert on exactly its rows, written into one buffer
        # (StackedMLP.forward_grouped); other expert banks are called expert by expert.
        padded_ok = cap * len(active) <= 2 * pairs and x.device.type != "cpu"
        if isinstance(self.experts, StackedMLP) and padded_ok:
            return self._dispatch_padded(x, weights, order, counts, active, cap)
        rows_all = order[:, 1]
        if isinstance(self.experts, StackedMLP):
            # One gather of the rows, E matmuls writing into one buffer, one weighting, one
            # scatter-add: the op count does not grow with the number of tensors per expert.
            y = self.experts.forward_grouped(x.index_select(0, rows_all), per_expert)
            w = weights[rows_all, :, order[:, 0]]  # (pairs, T): each pair's weight per task
            if t == 1 and not (torch.is_grad_enabled() and y.requires_grad):
                return y.new_zeros(1, b, y.shape[-1]).index_add_(1, rows_all, y.mul_(w)[None])
            contrib = w.t().unsqueeze(-1) * y.unsqueeze(0)  # (T, pairs, D)
            return y.new_zeros(t, b, y.shape[-1]).index_add_(1, rows_all, contrib)
        out: Tensor | None = None
        start = 0
        for expert in active:
            count = per_expert[expert]
            rows = rows_all[start : start + count]
            start += count
            member = rows.new_tensor([expert])
            y = self.experts(x.index_select(0, rows), member)[0]  # (R, D...)
            w = weights[:, :, expert].index_select(0, rows).t()  # (T, R)
            contrib = w.reshape(t, count, *([1] * (y.dim() - 1))) * y.unsqueeze(0)
            if out is None:
                out = y.new_zeros(t, b, *y.shape[1:])
            out.index_add_(1, rows, contrib)
        return out

    def _dispatch_padded(
        self,
        x: Tensor,
        weights: Tensor,
        order: Tensor,
        counts: Tensor,
        active: list[int],
        cap: int,
    ) -> Tensor:
        """Routing for stacked experts: every used expert's rows padded to ``cap``, one batched op.

        Padding slots read row 0 and get weight exactly 0 (masked), so they add nothing (as long
        as the experts' outputs on row 0 are finite).
        """
        b, t, e = weights.shape
        dev = weights.device
        experts_of_pair, rows = order[:, 0], order[:, 1]
        starts = torch.cumsum(counts, 0) - counts  # first pair of each expert
        pos = torch.arange(rows.shape[0], device=dev) - starts[experts_of_pair]
        slot_of_expert = torch.zeros(e, dtype=torch.long, device=dev)
        act = torch.tensor(active, dtype=torch.long, device=dev)
        slot_of_expert[act] = torch.arange(len(active), device=dev)
        slot = slot_of_expert[experts_of_pair]
        idx = torch.zeros(len(active), cap, dtype=torch.long, device=dev)
        idx[slot, pos] = rows
        valid = torch.zeros(len(active), cap, dtype=torch.bool, device=dev)
        valid[slot, pos] = True
        y = self.experts(x[idx], act)  # (A, cap, D)
        w = weights.permute(2, 0, 1).index_select(0, act)  # (A, B, T)
        w = torch.gather(w, 1, idx.unsqueeze(-1).expand(-1, -1, t))  # (A, cap, T)
        w = w.masked_fill(~valid.unsqueeze(-1), 0.0)
        out = y.new_zeros(t, b, y.shape[-1])
        if t == 1 and not (torch.is_grad_enabled() and y.requires_grad):
            contrib = y.mul_(w).unsqueeze(0)  # inference: scale the expert outputs in place
        else:
            contrib = w.permute(2, 0, 1).unsqueeze(-1) * y.unsqueeze(0)  # (T, A, cap, D)
        return out.index_add_(1, idx.flatten(), contrib.flatten(1, 2))
