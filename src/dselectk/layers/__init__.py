"""Layers: expert banks, task towers, the expert mixer and the per-token sparse MoE
feed-forward block."""

from dselectk.layers.experts import ExpertList, StackedMLP, make_towers
from dselectk.layers.mixer import ExpertMixer
from dselectk.layers.token_moe import Routing, SparseMoEFeedForward, TokenMoEOutput, balance_loss

__all__ = [
    "ExpertList",
    "ExpertMixer",
    "Routing",
    "SparseMoEFeedForward",
    "StackedMLP",
    "TokenMoEOutput",
    "balance_loss",
    "make_towers",
]
