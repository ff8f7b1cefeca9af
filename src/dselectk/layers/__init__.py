"""Layers: expert banks."""

from dselectk.layers.experts import ExpertList, StackedMLP

__all__ = ["ExpertList", "StackedMLP"]
