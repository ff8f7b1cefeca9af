"""Plots of the real-data experiments (Figure 4-like heatmaps, Figure C.2-like trajectories).

Self-contained (Matplotlib, Agg backend, PNG files); every function draws one figure from plain
arrays, saves it and closes it, so reports are rebuilt from run records alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dselectk_research.plots._mpl import plt
from dselectk_research.plots.core import save_png

__all__ = ["plot_task_heatmap", "plot_task_trajectories"]


def plot_task_heatmap(
    weights: Sequence[Sequence[float]] | np.ndarray,
    path: str | Path,
    *,
    title: str | None = None,
    task_names: Sequence[str] | None = None,
) -> Path:
    """Expert weights of each task's gate (rows tasks, columns experts), as in Figure 4.

    Args:
        weights: (T, n) gate weights (per-example gates: the mean over test examples).
        path: the PNG to write.
        title: figure title.
        task_names: row labels.
    """
    w = np.asarray(weights, dtype=float)
    t, n = w.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.55 * n + 1.5), 0.6 * t + 1.6))
    im = ax.imshow(w, aspect="auto", cmap="Blues", vmin=0.0, vmax=1.0)
    for i in range(t):
        for j in range(n):
            ax.text(
                j,
                i,
                f"{w[i, j]:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if w[i, j] > 0.6 else "black",
            )
    fig.colorbar(im, ax=ax, label="expert weight")
    ax.set_xticks(range(n))
    ax.set_xlabel("expert")
    ax.set_yticks(range(t))
    ax.set_yticklabels(list(task_names) if task_names else [f"task {i + 1}" for i in range(t)])
    if title:
        ax.set_title(title, fontsize=9)
    return _save(fig, path)


def plot_task_trajectories(
    steps: Sequence[int],
    weights: Sequence[Sequence[Sequence[float]]] | np.ndarray,
    path: str | Path,
    *,
    title: str | None = None,
    task_names: Sequence[str] | None = None,
) -> Path:
    """Expert weights of each task's gate during training, one panel per task (Figure C.2).

    Args:
        steps: (S,) training steps.
        weights: (S, T, n) gate weights at those steps.
        path: the PNG to write.
        title: figure title.
        task_names: panel titles.
    """
    w = np.asarray(weights, dtype=float)
    s = np.asarray(steps, dtype=float)
    if w.ndim != 3 or w.shape[0] != s.shape[0]:
        raise ValueError(f"weights must be (len(steps), T, n), got {w.shape}")
    t, n = w.shape[1:]
    fig, axes = plt.subplots(1, t, figsize=(5 * t, 3.6), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for k, ax in enumerate(axes[0]):
        for i in range(n):
            ax.plot(s, w[:, k, i], color=cmap(i % 10), lw=1.5, label=f"expert {i}")
        ax.set_xlabel("training step")
        ax.set_ylabel("expert weight")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(task_names[k] if task_names else f"task {k + 1}", fontsize=9)
    axes[0][-1].legend(fontsize=6, ncol=2, loc="upper right")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def _save(fig: plt.Figure, path: str | Path) -> Path:
    return save_png(fig, path, dpi=100)
