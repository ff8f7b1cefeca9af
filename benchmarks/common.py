"""Helpers shared by the benchmark items: the report tables, row building, subprocess runs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dselectk.gates import DSelectK, TopKGate

__all__ = ["REPO_ROOT", "Report", "dselect_out", "fwd_bwd", "row", "run_module", "topk_out"]

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The repository root: the parent of ``benchmarks/`` (cwd of the subprocesses we start)."""


class Report:
    """Collects rows per item, prints tables as they come, and serialises to JSON."""

    def __init__(self) -> None:
        self.items: dict[str, dict[str, Any]] = {}

    def table(self, item: str, title: str, rows: list[dict[str, Any]], note: str = "") -> None:
        self.items[item] = {"title": title, "rows": rows, "note": note}
        print(f"\n== {item}: {title}")
        if note:
            print(f"   {note}")
        head = f"{'case':<34} {'ours ms':>9} {'base ms':>9} {'base/ours':>9}  config"
        print(head)
        print("-" * len(head))
        for r in rows:
            ratio = r.get("ratio")
            ratio_s = f"{ratio:9.2f}" if isinstance(ratio, float) else f"{'':>9}"
            base = r.get("base_ms")
            base_s = f"{base:9.3f}" if isinstance(base, float) else f"{'':>9}"
            print(f"{r['case']:<34} {r['ours_ms']:9.3f} {base_s} {ratio_s}  {r.get('config', '')}")
        sys.stdout.flush()


def row(
    case: str, t: dict[str, dict[str, float]], ours: str, base: str | None, **config: Any
) -> dict[str, Any]:
    """One table row from ``compare``'s timings: ours (and the baseline's) median and min."""
    out: dict[str, Any] = {
        "case": case,
        "ours_ms": t[ours]["median_ms"],
        "ours_min_ms": t[ours]["min_ms"],
        "config": " ".join(f"{k}={v}" for k, v in config.items()),
    }
    if base is not None:
        out["base_ms"] = t[base]["median_ms"]
        out["base_min_ms"] = t[base]["min_ms"]
        out["ratio"] = t[base]["median_ms"] / t[ours]["median_ms"]
    return out


def fwd_bwd(fn: Callable[[], tuple[Tensor, Tensor]], g: Tensor) -> Callable[[], None]:
    """A step that runs ``fn`` (-> weights, aux loss) and backpropagates ``g`` and 1 into it."""

    def step() -> None:
        w, aux = fn()
        torch.autograd.backward([w, aux], [g, torch.ones_like(aux)])

    return step


def dselect_out(gate: DSelectK, x: Tensor) -> tuple[Tensor, Tensor]:
    """A DSelect-k gate's weights and auxiliary loss on ``x``."""
    o = gate(x)
    return o.weights, o.aux_loss


def topk_out(topk: TopKGate, x: Tensor) -> tuple[Tensor, Tensor]:
    """A Top-k gate's weights and auxiliary loss (tied to the weights so backward reaches them)."""
    o = topk(x)
    return o.weights, o.aux_loss + 0.0 * o.weights.sum()


def run_module(
    module: str, args: list[str], timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module args`` with this interpreter from the repository root."""
    env = dict(
        os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=timeout,
    )


def load_average() -> float:
    """The 1-minute load average, rounded (-1.0 where the platform has none): the load a
    benchmark row records beside its timings."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0
