"""dselectk: DSelect-k (Hazimeh et al., NeurIPS 2021) and competing gates for MoE models."""

from dselectk import functional
from dselectk.gates import (
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
from dselectk.runtime import tune_allocator

__version__ = "0.1.0"

__all__ = [
    "DSelectK",
    "Gate",
    "GateOutput",
    "GumbelSoftmaxGate",
    "SoftmaxGate",
    "SoftmaxSelectorGate",
    "TopKGate",
    "__version__",
    "functional",
    "gate_names",
    "make_gate",
    "tune_allocator",
]
