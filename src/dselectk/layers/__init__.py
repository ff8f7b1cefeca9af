"""Layers: expert banks (MLP and CNN), task towers, the expert mixer and the per-token sparse
MoE feed-forward block."""

from dselectk.layers.cnn import (
    BatchedCNNExperts,
    SingleCNN,
    load_from_reference,
    make_reference_cnn,
    make_towers,
)
from dselectk.layers.experts import ExpertList, StackedMLP
from dselectk.layers.mixer import ExpertMixer
from dselectk.layers.token_moe import Routing, SparseMoEFeedForward, TokenMoEOutput, balance_loss

__all__ = [
    "BatchedCNNExperts",
    "ExpertList",
    "ExpertMixer",
    "Routing",
    "SingleCNN",
    "SparseMoEFeedForward",
    "StackedMLP",
    "TokenMoEOutput",
    "balance_loss",
    "load_from_reference",
    "make_reference_cnn",
    "make_towers",
]
