"""Layers: expert banks, task towers, the expert mixer and the per-token sparse MoE
feed-forward block."""

from dselectk.layers.experts import ExpertList, GatedMLP, StackedMLP, grouped_linear, make_towers
from dselectk.layers.mixer import ExpertMixer
from dselectk.layers.token_moe import Routing, SparseMoEFeedForward, TokenMoEOutput, balance_loss

__all__ = [
    "ExpertList",
    "ExpertMixer",
    "GatedMLP",
    "Routing",
    "SparseMoEFeedForward",
    "StackedMLP",
    "TokenMoEOutput",
    "balance_loss",
    "grouped_linear",
    "make_towers",
]
