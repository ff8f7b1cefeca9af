"""Models: MoE, multi-gate MoE, shared bottom."""

from dselectk.models.moe import MoE, MoEOutput, MultiGateMoE, MultiTaskOutput, SharedBottom

__all__ = ["MoE", "MoEOutput", "MultiGateMoE", "MultiTaskOutput", "SharedBottom"]
