"""Moved to :mod:`dselectk.layers.cnn`; this re-export shim will be deleted."""

from dselectk.layers.cnn import (
    BatchedCNNExperts,
    SingleCNN,
    load_from_reference,
    make_reference_cnn,
    make_towers,
)

__all__ = [
    "BatchedCNNExperts",
    "SingleCNN",
    "load_from_reference",
    "make_reference_cnn",
    "make_towers",
]
