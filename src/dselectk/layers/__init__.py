"""Layers: expert banks (MLP and CNN) and task towers."""

from dselectk.layers.cnn import (
    BatchedCNNExperts,
    SingleCNN,
    load_from_reference,
    make_reference_cnn,
    make_towers,
)
from dselectk.layers.experts import ExpertList, StackedMLP

__all__ = [
    "BatchedCNNExperts",
    "ExpertList",
    "SingleCNN",
    "StackedMLP",
    "load_from_reference",
    "make_reference_cnn",
    "make_towers",
]
