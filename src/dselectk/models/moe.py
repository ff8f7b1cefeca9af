"""Mixture of experts (Eq. 1), multi-gate MoE (Figure 1, right) and the shared-bottom baseline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from dselectk.gates.base import Gate
from dselectk.layers.mixer import ExpertMixer

__all__ = ["MoE", "MoEOutput", "MultiGateMoE", "MultiTaskOutput", "SharedBottom"]


class MoEOutput(NamedTuple):
    """Output of :class:`MoE`.

    Examples:
        >>> from dselectk import MoE, SoftmaxGate
        >>> from dselectk.layers import StackedMLP
        >>> moe = MoE(StackedMLP(4, 16, [8]), SoftmaxGate(4, in_features=16))
        >>> output, aux_loss, weights = moe(torch.randn(4, 16))
        >>> tuple(output.shape), aux_loss.dim(), tuple(weights.shape)
        ((4, 8), 0, (4, 4))
    """

    output: Tensor
    """(B, D) mixture Σ_i f_i(x) g(x)_i."""
    aux_loss: Tensor
    """Scalar auxiliary loss of the gate."""
    weights: Tensor
    """Gate weights, (n,) static or (B, n) per-example."""


class MultiTaskOutput(NamedTuple):
    """Output of the multi-task models.

    Examples:
        >>> from dselectk import DSelectK, MultiGateMoE
        >>> from dselectk.layers import StackedMLP
        >>> model = MultiGateMoE(StackedMLP(4, 16, [8]), DSelectK(4, k=2, num_gates=2))
        >>> outputs, aux_loss, gate_weights = model(torch.randn(4, 16))
        >>> [tuple(o.shape) for o in outputs], aux_loss.dim(), tuple(gate_weights.shape)
        ([(4, 8), (4, 8)], 0, (2, 4))
    """

    outputs: list[Tensor]
    """One (B, out_t) tensor per task."""
    aux_loss: Tensor
    """Scalar: sum of every gate's auxiliary loss."""
    gate_weights: Tensor | None
    """(T, n) for static gates, (B, T, n) otherwise; None for :class:`SharedBottom`."""


def _check_bottom(bottom: nn.Module | None) -> nn.Module | None:
    if bottom is not None and not callable(bottom):
        raise TypeError(f"bottom must be a module (or None), got {type(bottom).__name__}")
    return bottom


class MoE(nn.Module):
    """A mixture of experts with one gate: Σ_i f_i(x) g(x)_i (Eq. 1).

    Args:
        experts: an expert bank (:class:`~dselectk.layers.StackedMLP` or
            :class:`~dselectk.layers.ExpertList`) with E members.
        gate: a single gate (``num_gates=None``) over E experts.
        conditional: skip experts the gate gives exactly zero weight (exact; see
            :meth:`~dselectk.layers.ExpertMixer.mix`).

    Examples:
        >>> from dselectk import MoE, TopKGate
        >>> from dselectk.layers import StackedMLP
        >>> moe = MoE(StackedMLP(4, 16, [8]), TopKGate(4, k=2, in_features=16))  # 4 experts
        >>> out = moe(torch.randn(4, 16))  # (batch, in_features)
        >>> tuple(out.output.shape), tuple(out.weights.shape), out.aux_loss.dim()
        ((4, 8), (4, 4), 0)
    """

    def __init__(self, experts: nn.Module, gate: Gate, *, conditional: bool = True) -> None:
        super().__init__()
        self.mixer = ExpertMixer(experts, conditional)
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

    Examples:
        >>> from dselectk import DSelectK, MultiGateMoE
        >>> from dselectk.layers import StackedMLP, make_towers
        >>> experts = StackedMLP(4, 16, [8])  # 4 experts 16 -> 8
        >>> gates = DSelectK(4, k=2, num_gates=2)  # one static gate per task
        >>> model = MultiGateMoE(experts, gates, make_towers(2, 8, [1]))  # 2 towers 8 -> 1
        >>> out = model(torch.randn(4, 16))
        >>> [tuple(o.shape) for o in out.outputs], tuple(out.gate_weights.shape)
        ([(4, 1), (4, 1)], (2, 4))
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
        self.mixer = ExpertMixer(experts, conditional)
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
        self.bottom = _check_bottom(bottom)

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

    Examples:
        >>> from dselectk.layers import make_towers
        >>> from dselectk.models import SharedBottom
        >>> model = SharedBottom(nn.Sequential(nn.Linear(16, 8), nn.ReLU()), make_towers(2, 8, [1]))
        >>> out = model(torch.randn(4, 16))
        >>> [tuple(o.shape) for o in out.outputs], out.gate_weights, float(out.aux_loss)
        ([(4, 1), (4, 1)], None, 0.0)
    """

    def __init__(
        self,
        shared: nn.Module,
        towers: Sequence[nn.Module] | nn.Module,
        *,
        bottom: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if not callable(shared):
            raise TypeError(f"shared must be a module, got {type(shared).__name__}")
        self.shared = shared
        self.bottom = _check_bottom(bottom)
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
