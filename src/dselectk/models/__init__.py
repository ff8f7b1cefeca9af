"""Models: MoE, multi-gate MoE, shared bottom, and banks of independent multi-gate MoEs."""

from dselectk.models.bank import MoEBank
from dselectk.models.moe import MoE, MoEOutput, MultiGateMoE, MultiTaskOutput, SharedBottom

__all__ = ["MoE", "MoEBank", "MoEOutput", "MultiGateMoE", "MultiTaskOutput", "SharedBottom"]
