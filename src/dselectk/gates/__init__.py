"""Gates: DSelect-k and the competing gates of the paper, behind one interface (plus COMET's
tree gate, a later gate by the same group)."""

from dselectk.gates.ablation import DSelectKExtended, SoftmaxSelectorGate
from dselectk.gates.base import Gate, GateOutput
from dselectk.gates.comet import COMETGate
from dselectk.gates.dselect_k import DSelectK
from dselectk.gates.gumbel import GumbelSoftmaxGate
from dselectk.gates.registry import (
    GATES,
    GateSpec,
    HParam,
    gate_names,
    gate_spec,
    make_gate,
    register_gate,
)
from dselectk.gates.softmax import SoftmaxGate
from dselectk.gates.topk import TopKGate

__all__ = [
    "GATES",
    "COMETGate",
    "DSelectK",
    "DSelectKExtended",
    "Gate",
    "GateOutput",
    "GateSpec",
    "GumbelSoftmaxGate",
    "HParam",
    "SoftmaxGate",
    "SoftmaxSelectorGate",
    "TopKGate",
    "gate_names",
    "gate_spec",
    "make_gate",
    "register_gate",
]
