"""Item ``memory``: peak memory of the per-example gate at B = 4096, n = 1024, k = 4.

Each measurement runs in a fresh process (``python -m benchmarks.memory_child``), so that the
parent's allocations do not mask the gate's peak.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from benchmarks.common import Report, run_module
from benchmarks.memory_child import DEFAULTS, size_args
from dselectk import functional as DF


def mem_child(kind: str, dev: torch.device, **sizes: int) -> dict[str, Any]:
    """Run the memory child for ``kind`` on ``dev``; its JSON result, or an error entry."""
    sizes = {**DEFAULTS, **sizes}
    res = run_module("benchmarks.memory_child", [kind, str(dev), *size_args(**sizes)], 600)
    if res.returncode != 0:
        return {"error": float("nan"), "stderr": res.stderr[-500:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def run(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    b, n, k = DEFAULTS["batch"], DEFAULTS["experts"], DEFAULTS["k"]
    m = DF.num_bits(n)
    bkmn_mb = b * k * n * m * 4 / 2**20
    ours = mem_child("ours", dev)
    rows: list[dict[str, Any]] = []
    base = None if args.quick else mem_child("naive", dev)
    key = "cuda_peak_mb" if dev.type == "cuda" else "rss_growth_mb"
    row: dict[str, Any] = {
        "case": "peak memory growth (MB) fwd+bwd",
        "ours_ms": float(ours.get(key, float("nan"))),
        "config": f"B={b} n={n} k={k} B*K*n*m*4B={bkmn_mb:.0f}MB output B*n*4B="
        f"{b * n * 4 / 2**20:.0f}MB",
        "ours": ours,
    }
    if base is not None:
        row["base_ms"] = float(base.get(key, float("nan")))
        row["ratio"] = row["base_ms"] / max(row["ours_ms"], 1e-9)
        row["base"] = base
    rows.append(row)
    rep.table(
        "memory",
        "per-example gate, B=4096 n=1024 k=4: peak memory in a fresh process (columns are MB)",
        rows,
        f"{key}: peak RSS (VmHWM, reset after setup) during two fwd+bwd minus RSS before; "
        f"process peak RSS: ours {ours.get('rss_peak_mb', float('nan')):.0f} MB"
        + ("" if base is None else f", product table {base.get('rss_peak_mb', 0.0):.0f} MB"),
    )
