"""Generic plots shared by the experiment reports (Figures 2, C.1, C.3, C.4 of the paper).

Importing this package does not import matplotlib (the ``experiments`` extra); drawing a plot
without it raises an ImportError that says ``pip install matplotlib``.
"""

from dselectk_research.plots._mpl import optional_plot
from dselectk_research.plots.core import (
    plot_metric_panels,
    plot_metric_vs,
    plot_trajectories,
    plot_weight_heatmap,
)

__all__ = [
    "optional_plot",
    "plot_metric_panels",
    "plot_metric_vs",
    "plot_trajectories",
    "plot_weight_heatmap",
]
