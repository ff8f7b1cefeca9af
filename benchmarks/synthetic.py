"""Item ``synthetic`` (only with ``--synthetic``): wall time of ``benchmarks/bench_synthetic.py``.

Runs it as ``python -m benchmarks.bench_synthetic --json`` from the repository root and reports
its batched vs one-at-a-time training time.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from benchmarks.common import REPO_ROOT, Report, run_module


def run(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    if not (REPO_ROOT / "benchmarks" / "bench_synthetic.py").exists():
        print("\n== synthetic: benchmarks/bench_synthetic.py not present, skipped")
        return
    opts = ["--json"]
    if args.quick:
        opts += ["--reps", "2", "--steps", "8", "--tasks", "16", "--gates", "dselect_k"]
    t0 = time.perf_counter()
    res = run_module("benchmarks.bench_synthetic", opts)
    wall = time.perf_counter() - t0
    data: dict[str, Any] = {}
    for line in reversed(res.stdout.strip().splitlines()):
        if line.startswith("{"):
            data = json.loads(line)
            break
    row: dict[str, Any] = {
        "case": "synthetic: batched vs one at a time",
        "ours_ms": data.get("batched_s", float("nan")) * 1e3,
        "base_ms": data.get("sequential_s", float("nan")) * 1e3,
        "ratio": data.get("ratio", float("nan")),
        "config": f"{' '.join(opts[1:])} bench wall {wall:.1f}s "
        f"full-protocol estimate {data.get('full_estimate_s', float('nan')) / 3600:.2f}h",
        "raw": data,
        "returncode": res.returncode,
    }
    rep.table("synthetic", "synthetic protocol (benchmarks/bench_synthetic.py)", [row])
