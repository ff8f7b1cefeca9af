"""Name → gate constructor, so configs and the CLI can name every gate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dselectk.gates.ablation import SoftmaxSelectorGate
from dselectk.gates.base import Gate
from dselectk.gates.comet import COMETGate
from dselectk.gates.dselect_k import DSelectK
from dselectk.gates.gumbel import GumbelSoftmaxGate
from dselectk.gates.softmax import SoftmaxGate
from dselectk.gates.topk import TopKGate

__all__ = ["GATES", "gate_names", "make_gate", "register_gate"]

GATES: dict[str, Callable[..., Gate]] = {}


def register_gate(name: str, factory: Callable[..., Gate]) -> None:
    """Register ``factory(num_experts, **kwargs) -> Gate`` under ``name``."""
    if name in GATES:
        raise ValueError(f"a gate named {name!r} is already registered")
    GATES[name] = factory


def gate_names() -> list[str]:
    """Registered gate names, sorted."""
    return sorted(GATES)


def make_gate(name: str, num_experts: int, **kwargs: Any) -> Gate:
    """Build the gate registered as ``name``.

    Args:
        name: one of :func:`gate_names`.
        num_experts: n.
        **kwargs: passed to the gate's constructor (``k``, ``in_features``, ``num_gates``, ...).
    """
    if name not in GATES:
        raise ValueError(f"unknown gate {name!r}; expected one of {gate_names()}")
    return GATES[name](num_experts, **kwargs)


def _ablation_entropy(num_experts: int, **kw: Any) -> Gate:
    return SoftmaxSelectorGate(num_experts, **kw)


def _ablation_annealing(num_experts: int, **kw: Any) -> Gate:
    reg = kw.get("entropy_reg", 0.0)
    if bool(torch.as_tensor(reg, dtype=torch.float64).ne(0).any()):  # a number or one per gate
        raise ValueError("ablation_annealing uses temperature annealing, not entropy_reg")
    return SoftmaxSelectorGate(num_experts, **kw)


register_gate("dselect_k", DSelectK)
register_gate("topk", TopKGate)
register_gate("softmax", SoftmaxGate)
register_gate("gumbel_softmax", GumbelSoftmaxGate)
register_gate("ablation_entropy", _ablation_entropy)
register_gate("ablation_annealing", _ablation_annealing)
register_gate("comet", COMETGate)
