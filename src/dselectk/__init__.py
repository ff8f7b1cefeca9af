"""dselectk: DSelect-k (Hazimeh et al., NeurIPS 2021) and competing gates for MoE models.

The top-level API is the gates, the expert layers and the models (what the README's examples
use). Process tuning (:func:`dselectk.runtime.tune_allocator`), the training loop
(:mod:`dselectk.training`) and the experiments live in their own modules.
"""

from typing import Any

from dselectk import functional
from dselectk.gates import (
    COMETGate,
    DSelectK,
    Gate,
    GateOutput,
    GumbelSoftmaxGate,
    SoftmaxGate,
    SoftmaxSelectorGate,
    TopKGate,
    gate_names,
    make_gate,
)
from dselectk.layers import ExpertList, StackedMLP
from dselectk.models import MoE, MoEOutput, MultiGateMoE, MultiTaskOutput, SharedBottom

__version__ = "0.1.0"

__all__ = [
    "COMETGate",
    "DSelectK",
    "ExpertList",
    "Gate",
    "GateOutput",
    "GumbelSoftmaxGate",
    "MoE",
    "MoEOutput",
    "MultiGateMoE",
    "MultiTaskOutput",
    "SharedBottom",
    "SoftmaxGate",
    "SoftmaxSelectorGate",
    "StackedMLP",
    "TopKGate",
    "__version__",
    "functional",
    "gate_names",
    "make_gate",
]


def __getattr__(name: str) -> Any:
    # `dselectk.tune_allocator` was top-level API; it lives in dselectk.runtime (kept reachable
    # here, lazily, for existing callers; not in __all__).
    if name == "tune_allocator":
        from dselectk.runtime import tune_allocator

        return tune_allocator
    raise AttributeError(f"module 'dselectk' has no attribute {name!r}")
