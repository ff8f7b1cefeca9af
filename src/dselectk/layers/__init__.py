"""Layers: expert banks (MLP and CNN), task towers and the expert mixer."""

from dselectk.layers.cnn import (
    BatchedCNNExperts,
    SingleCNN,
    load_from_reference,
    make_reference_cnn,
    make_towers,
)
from dselectk.layers.experts import ExpertList, StackedMLP
from dselectk.layers.mixer import ExpertMixer

__all__ = [
    "BatchedCNNExperts",
    "ExpertList",
    "ExpertMixer",
    "SingleCNN",
    "StackedMLP",
    "load_from_reference",
    "make_reference_cnn",
    "make_towers",
]
