"""Matplotlib helpers (Agg backend, PNG files) used by every experiment's ``write_report``.

All helpers take plain sequences or tensors and a destination path, draw one figure, save it and
close it, so reports can be rebuilt from run records without any training state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dselectk.io import write_stream
from dselectk_research.plots._mpl import plt

__all__ = ["plot_metric_panels", "plot_metric_vs", "plot_trajectories", "plot_weight_heatmap"]

#: one series: x values, means, standard errors (None or NaN: no error bar)
Series = tuple[Sequence[float], Sequence[float], Sequence[float] | None]


def _draw_series(
    ax: Any,
    series: Mapping[str, Series],
    reference: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None,
) -> None:
    for label, (xs, means, ses) in series.items():
        m = np.asarray(means, dtype=float)
        e = None if ses is None else np.nan_to_num(np.asarray(ses, dtype=float), nan=0.0)
        ax.errorbar(np.asarray(xs, dtype=float), m, yerr=e, marker="o", capsize=3, label=label)
    for label, (xs, ys) in (reference or {}).items():
        ax.plot(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), "k--", label=label)


def plot_metric_vs(
    series: Mapping[str, Series],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    reference: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    logx: bool = False,
    logy: bool = False,
) -> Path:
    """One metric (mean ± standard error) against a setting, one line per gate.

    Args:
        series: label → (x values, means, standard errors or None).
        path: the PNG to write.
        xlabel, ylabel, title: axis labels and title.
        reference: label → (x values, y values) drawn as dashed lines (e.g. a random gate).
        logx: log-2 x axis (numbers of tasks).
        logy: log y axis (e.g. MSEs that differ by orders of magnitude).

    Returns:
        The path written.
    """
    fig, ax = plt.subplots(figsize=(5, 4))
    _draw_series(ax, series, reference)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_png(fig, path)


def plot_metric_panels(
    panels: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    xlabel: str,
    logx: bool = False,
    suptitle: str | None = None,
) -> Path:
    """Several :func:`plot_metric_vs` panels side by side (e.g. the three panels of Fig. C.1).

    Args:
        panels: one mapping per panel with keys ``series``, ``ylabel`` and optionally
            ``reference``, ``title`` and ``logy`` (log y axis).
        path: the PNG to write.
        xlabel: shared x label.
        logx: log-2 x axes.
        suptitle: figure title.
    """
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        _draw_series(ax, panel["series"], panel.get("reference"))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(panel["ylabel"])
        if panel.get("title"):
            ax.set_title(panel["title"])
        if logx:
            ax.set_xscale("log", base=2)
        if panel.get("logy"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if suptitle:
        fig.suptitle(suptitle)
    return save_png(fig, path)


def plot_trajectories(
    steps: Sequence[int],
    weights: Sequence[Sequence[float]] | np.ndarray,
    path: str | Path,
    *,
    title: str | None = None,
    highlight: Sequence[int] | None = None,
    zoom_steps: int | None = None,
) -> Path:
    """Expert weights against training steps, one line per expert (Figures 2, C.3, C.4).

    Args:
        steps: (S,) training steps.
        weights: (S, n) expert weights at those steps.
        path: the PNG to write.
        title: figure title.
        highlight: experts drawn with solid thick lines (e.g. the true experts); the others
            dotted.
        zoom_steps: if given, add a left panel restricted to the first ``zoom_steps`` steps
            (the paper's "magnified" panel).
    """
    w = np.asarray(weights, dtype=float)
    s = np.asarray(steps, dtype=float)
    if w.ndim != 2 or w.shape[0] != s.shape[0]:
        raise ValueError(f"weights must be (len(steps), n), got {w.shape} for {s.shape[0]} steps")
    n_panels = 2 if zoom_steps else 1
    fig, axes = plt.subplots(1, n_panels, figsize=(5.5 * n_panels, 4), squeeze=False)
    hl = set(highlight or [])
    cmap = plt.get_cmap("tab20")
    for p, ax in enumerate(axes[0]):
        keep = s <= zoom_steps if (zoom_steps and p == 0) else np.ones_like(s, dtype=bool)
        for i in range(w.shape[1]):
            style = {"lw": 2.0, "ls": "-"} if (not hl or i in hl) else {"lw": 1.0, "ls": ":"}
            label = f"expert {i}" + (" (true)" if i in hl else "")
            ax.plot(s[keep], w[keep, i], color=cmap(i % 20), label=label, **style)
        ax.set_xlabel("training step")
        ax.set_ylabel("expert weight")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        if zoom_steps and p == 0:
            ax.set_title(f"first {zoom_steps} steps")
    axes[0][-1].legend(fontsize=6, ncol=2, loc="upper right")
    if title:
        fig.suptitle(title)
    return save_png(fig, path)


def plot_weight_heatmap(
    weights: Sequence[Sequence[float]] | np.ndarray,
    path: str | Path,
    *,
    title: str | None = None,
    row_groups: Sequence[int] | None = None,
) -> Path:
    """Expert weights per task as a heatmap (rows tasks, columns experts).

    Args:
        weights: (T, n) gate weights.
        path: the PNG to write.
        title: figure title.
        row_groups: (T,) group label of each task; horizontal lines separate groups.
    """
    w = np.asarray(weights, dtype=float)
    t, n = w.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.25 * n + 2), max(3.0, min(12.0, 0.08 * t + 2))))
    im = ax.imshow(w, aspect="auto", cmap="viridis", vmin=0.0, vmax=max(1e-9, float(w.max())))
    fig.colorbar(im, ax=ax, label="weight")
    if row_groups is not None:
        g = list(row_groups)
        for r in range(1, t):
            if g[r] != g[r - 1]:
                ax.axhline(r - 0.5, color="white", lw=1)
    ax.set_xlabel("expert")
    ax.set_ylabel("task")
    if title:
        ax.set_title(title)
    return save_png(fig, path)


def save_png(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG atomically (a crash never leaves a truncated plot) and close it."""
    path = Path(path)
    fig.tight_layout()
    try:
        write_stream(path, lambda f: fig.savefig(f, dpi=dpi, format="png"))
    finally:
        plt.close(fig)
    return path


def finite(x: float | None) -> float:
    """``x`` as a float, NaN for None (JSON null)."""
    return math.nan if x is None else float(x)
