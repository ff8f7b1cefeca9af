"""dselectk: DSelect-k (Hazimeh et al., NeurIPS 2021) and competing gates for MoE models.

The top level is what a model needs: the gates (:class:`DSelectK`, :class:`TopKGate`,
:class:`SoftmaxGate`, :class:`COMETGate`, :class:`GumbelSoftmaxGate`, and :func:`make_gate` by
name), the models (:class:`MoE`, :class:`MultiGateMoE`, :class:`MoEBank`) and the per-token layer
(:class:`SparseMoEFeedForward`), training (:func:`train`, :class:`TrainConfig`,
:class:`TaskData`) and the swap search (:class:`SwapSearch`). Everything else lives in its
submodule: expert banks and towers in :mod:`dselectk.layers` (``StackedMLP``, ``make_towers``),
output types and ``SharedBottom`` in :mod:`dselectk.models`, the gate contract, the registry and
the ablation gates in :mod:`dselectk.gates`, callbacks and losses in :mod:`dselectk.training`,
process tuning in :mod:`dselectk.runtime`.
"""

from typing import Any

from dselectk.gates import (
    COMETGate,
    DSelectK,
    GumbelSoftmaxGate,
    SoftmaxGate,
    TopKGate,
    make_gate,
)
from dselectk.layers import SparseMoEFeedForward
from dselectk.models import MoE, MoEBank, MultiGateMoE
from dselectk.search import SwapSearch
from dselectk.training import TaskData, TrainConfig, train

__version__ = "0.1.0"

__all__ = [
    "COMETGate",
    "DSelectK",
    "GumbelSoftmaxGate",
    "MoE",
    "MoEBank",
    "MultiGateMoE",
    "SoftmaxGate",
    "SparseMoEFeedForward",
    "SwapSearch",
    "TaskData",
    "TopKGate",
    "TrainConfig",
    "make_gate",
    "train",
]


def __getattr__(name: str) -> Any:
    # `dselectk.tune_allocator` was top-level API; it lives in dselectk.runtime (kept reachable
    # here, lazily, for existing callers; not in __all__).
    if name == "tune_allocator":
        from dselectk.runtime import tune_allocator

        return tune_allocator
    raise AttributeError(f"module 'dselectk' has no attribute {name!r}")
