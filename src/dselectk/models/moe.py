"""Mixture of experts (Eq. 1), multi-gate MoE (Figure 1, right) and the shared-bottom baseline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from dselectk.gates.base import Gate
from dselectk.layers.experts import StackedMLP

__all__ = ["MoE", "MoEOutput", "MultiGateMoE", "MultiTaskOutput", "SharedBottom"]


class MoEOutput(NamedTuple):
    """Output of :class:`MoE`."""

    output: Tensor
    """(B, D) mixture Σ_i f_i(x) g(x)_i."""
    aux_loss: Tensor
    """Scalar auxiliary loss of the gate."""
    weights: Tensor
    """Gate weights, (n,) static or (B, n) per-example."""


class MultiTaskOutput(NamedTuple):
    """Output of the multi-task models."""

    outputs: list[Tensor]
    """One (B, out_t) tensor per task."""
    aux_loss: Tensor
    """Scalar: sum of every gate's auxiliary loss."""
    gate_weights: Tensor | None
    """(T, n) for static gates, (B, T, n) otherwise; None for :class:`SharedBottom`."""


def _active_experts(weights: Tensor, num_experts: int) -> Tensor | None:
    """Indices of the experts some gate weight uses, or None when all are used."""
    used = (weights != 0).reshape(-1, num_experts).any(dim=0)
    if bool(used.all()):
        return None
    return used.nonzero().squeeze(-1)


def _mix(expert_out: Tensor, weights: Tensor) -> Tensor:
    """Combine (E, B, D) expert outputs with (T, E) or (B, T, E) weights into (T, B, D)."""
    if weights.dim() == 2:  # static: one matmul for all tasks
        e, b, d = expert_out.shape
        return (weights @ expert_out.reshape(e, b * d)).view(-1, b, d)
    return torch.bmm(weights, expert_out.transpose(0, 1)).transpose(0, 1)  # (T, B, D)


class _ExpertMixer(nn.Module):
    """Experts + gates → mixed expert outputs, with automatic conditional computation."""

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
        self.conditional = bool(conditional)

    def mix(self, x: Tensor, weights: Tensor) -> Tensor:
        """(T, B, D) mixtures. Experts no weight uses are skipped, forward and backward.

        Skipping is exact: an expert whose weight is exactly zero in every gate contributes
        nothing to the output, and DSelect-k and Top-k weights that are exactly zero have exactly
        zero gradients as well (S'(z) = 0 on binary bits; top-k masks).
        """
        if self.conditional and weights.dim() == 3 and not self.training:
            routed = self.dispatch(x, weights)
            if routed is not None:
                return routed
        active = _active_experts(weights, self.num_experts) if self.conditional else None
        if active is None:
            return _mix(self.experts(x), weights)
        return _mix(self.experts(x, active), weights.index_select(-1, active))

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
            (T, B, D...) mixtures, or None when the weights are not sparse enough.
        """
        b, t, e = weights.shape
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


class MoE(nn.Module):
    """A mixture of experts with one gate: Σ_i f_i(x) g(x)_i (Eq. 1).

    Args:
        experts: an expert bank (:class:`~dselectk.layers.StackedMLP` or
            :class:`~dselectk.layers.ExpertList`) with E members.
        gate: a single gate (``num_gates=None``) over E experts.
        conditional: skip experts the gate gives exactly zero weight (exact; see
            :meth:`_ExpertMixer.mix`).
    """

    def __init__(self, experts: nn.Module, gate: Gate, *, conditional: bool = True) -> None:
        super().__init__()
        self.mixer = _ExpertMixer(experts, conditional)
        if not isinstance(gate, Gate):
            raise TypeError(f"gate must be a dselectk Gate, got {type(gate).__name__}")
        if gate.num_experts != self.mixer.num_experts:
            raise ValueError(
                f"gate has num_experts={gate.num_experts} but experts has "
                f"{self.mixer.num_experts} members"
            )
        if gate.num_gates is not None:
            raise ValueError("MoE takes a single gate (num_gates=None); see MultiGateMoE")
        self.gate = gate

    def forward(self, x: Tensor) -> MoEOutput:
        out = self.gate(None if self.gate.static else x)
        w = out.weights.unsqueeze(-2)  # (1, n) or (B, 1, n)
        return MoEOutput(self.mixer.mix(x, w)[0], out.aux_loss, out.weights)


class MultiGateMoE(nn.Module):
    """Multi-gate MoE (Ma et al., 2018; Figure 1, right): shared experts, one gate per task.

    Args:
        experts: an expert bank with E members taking the (bottom's) input.
        gates: either one gate module with ``num_gates=T`` (all tasks' gates computed in one
            batched op; preferred) or a sequence of T single gates (any mix of kinds).
        towers: T task towers applied to each task's mixture, a
            :class:`~dselectk.layers.StackedMLP` with T members (one batched op), or None
            (the mixtures are the outputs).
        bottom: optional module applied to the input first (e.g. embeddings); experts and
            per-example gates see its output.
        conditional: skip experts no task uses (exact; automatic once gates are sparse).
    """

    def __init__(
        self,
        experts: nn.Module,
        gates: Gate | Sequence[Gate],
        towers: Sequence[nn.Module] | nn.Module | None = None,
        *,
        bottom: nn.Module | None = None,
        conditional: bool = True,
    ) -> None:
        super().__init__()
        self.mixer = _ExpertMixer(experts, conditional)
        n = self.mixer.num_experts
        if isinstance(gates, Gate):
            if gates.num_gates is None:
                raise ValueError("a single gate module must have num_gates=T (one per task)")
            self.num_tasks = gates.num_gates
            self.gates: nn.Module = gates
            gate_list: list[Gate] = [gates]
        else:
            gate_list = list(gates)
            if not gate_list:
                raise ValueError("gates must hold at least one gate")
            for i, g in enumerate(gate_list):
                if not isinstance(g, Gate):
                    raise TypeError(f"gates[{i}] must be a dselectk Gate, got {type(g).__name__}")
                if g.num_gates is not None:
                    raise ValueError(f"gates[{i}] must be a single gate (num_gates=None)")
            self.num_tasks = len(gate_list)
            self.gates = nn.ModuleList(gate_list)
        for i, g in enumerate(gate_list):
            if g.num_experts != n:
                raise ValueError(f"gate {i} has num_experts={g.num_experts}, experts has {n}")
        self.towers = self._check_towers(towers)
        self.bottom = bottom

    def _check_towers(self, towers: Sequence[nn.Module] | nn.Module | None) -> nn.Module | None:
        if towers is None:
            return None
        if isinstance(towers, nn.Module) and not isinstance(towers, nn.ModuleList):
            count = getattr(towers, "num_members", None)
            if count != self.num_tasks:
                raise ValueError(
                    f"towers must have one member per task ({self.num_tasks}), got {count}"
                )
            return towers
        towers = nn.ModuleList(towers)
        if len(towers) != self.num_tasks:
            raise ValueError(f"towers must hold {self.num_tasks} modules, got {len(towers)}")
        return towers

    def gate_weights(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """Stacked gate weights ((T, n) if all gates are static, else (B, T, n)) and aux loss."""
        if isinstance(self.gates, Gate):
            out = self.gates(None if self.gates.static else h)
            return out.weights, out.aux_loss
        assert isinstance(self.gates, nn.ModuleList)
        outs = [g(None if g.static else h) for g in self.gates]
        aux = torch.stack([o.aux_loss for o in outs]).sum()
        ws = [o.weights for o in outs]
        if all(w.dim() == 1 for w in ws):
            return torch.stack(ws), aux
        b = h.shape[0]
        return torch.stack([w.expand(b, -1) for w in ws], dim=1), aux

    def forward(self, x: Tensor) -> MultiTaskOutput:
        h = x if self.bottom is None else self.bottom(x)
        weights, aux = self.gate_weights(h)
        mixed = self.mixer.mix(h, weights)  # (T, B, D)
        return MultiTaskOutput(_apply_towers(self.towers, mixed), aux, weights)


def _apply_towers(towers: nn.Module | None, mixed: Tensor) -> list[Tensor]:
    """Per-task outputs from (T, B, D) inputs."""
    if towers is None:
        return list(mixed.unbind(0))
    if isinstance(towers, nn.ModuleList):
        return [t(m) for t, m in zip(towers, mixed.unbind(0))]
    return list(towers(mixed).unbind(0))


class SharedBottom(nn.Module):
    """Shared-bottom multi-task baseline (Caruana, 1997): one shared network, T towers.

    Args:
        shared: the shared network.
        towers: T towers, a StackedMLP with T members, or a sequence of modules.
        num_tasks: T (checked against ``towers``).
        bottom: optional module applied before ``shared`` (e.g. embeddings).
    """

    def __init__(
        self,
        shared: nn.Module,
        towers: Sequence[nn.Module] | nn.Module,
        *,
        bottom: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.shared = shared
        self.bottom = bottom
        if isinstance(towers, nn.Module) and not isinstance(towers, nn.ModuleList):
            count = getattr(towers, "num_members", None)
            if not isinstance(count, int):
                raise TypeError("towers must be a StackedMLP or a sequence of modules")
            self.num_tasks = count
            self.towers: nn.Module = towers
        else:
            self.towers = nn.ModuleList(towers)
            self.num_tasks = len(self.towers)
            if self.num_tasks < 1:
                raise ValueError("towers must hold at least one module")

    def forward(self, x: Tensor) -> MultiTaskOutput:
        h = x if self.bottom is None else self.bottom(x)
        s = self.shared(h)
        mixed = s.unsqueeze(0).expand(self.num_tasks, *s.shape)
        return MultiTaskOutput(_apply_towers(self.towers, mixed), s.new_zeros(()), None)
