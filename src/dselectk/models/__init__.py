"""Models: MoE, multi-gate MoE, shared bottom, and banks of independent multi-gate MoEs."""

from dselectk.models.bank import BankOutput, MoEBank
from dselectk.models.moe import MoE, MoEOutput, MultiGateMoE, MultiTaskOutput, SharedBottom

__all__ = [
    "BankOutput",
    "MoE",
    "MoEBank",
    "MoEOutput",
    "MultiGateMoE",
    "MultiTaskOutput",
    "SharedBottom",
]
