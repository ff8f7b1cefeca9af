"""The per-example gate on a GPU: which of DSelect-k's kernels is fastest at each batch size.

``python -m benchmarks.gpu_gate [--device cuda] [--out FILE]``: forward + backward of a
per-example gate (p = 64, n = 128, k = 4, float32, as ``small_batch``) at B = 1, 16, 256, 4096,
timed interleaved in one process: Top-k; DSelect-k as dispatched today (on a GPU with Triton: its
two Triton kernels, ``dselectk.kernels.triton_cuda``); DSelect-k forced onto each of its three ATen
formulations (the small-problem kernel, the fused kernel, the composed autograd formulas:
``dselectk.kernels.dispatch``'s size thresholds set and ``DSELECTK_TRITON=0`` for the call); and
``torch.compile`` of both gates. Also counts the device kernels one step launches (torch's
profiler): on a GPU a step this small costs its launches, not its arithmetic. Prints one table;
``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import dselectk.kernels.dispatch as dispatch
from benchmarks.common import dselect_out, fwd_bwd, topk_out
from benchmarks.small_batch import gate_steps
from benchmarks.timing import compare, machine_facts

BATCHES = (1, 16, 256, 4096)
HUGE = 2**62
#: formulation -> the dselectk.kernels.dispatch size thresholds that force it at every size
FORCED = {
    "small": {
        "SMALL_MAX_ELEMENTS": HUGE,
        "FUSED_MIN_ELEMENTS": HUGE + 1,
        "CUDA_SMALL_MAX_ELEMENTS": HUGE,
    },
    "fused": {"SMALL_MAX_ELEMENTS": 0, "FUSED_MIN_ELEMENTS": 1, "CUDA_SMALL_MAX_ELEMENTS": 0},
    "composed": {"SMALL_MAX_ELEMENTS": 0, "FUSED_MIN_ELEMENTS": HUGE, "CUDA_SMALL_MAX_ELEMENTS": 0},
}


def forced(step: Callable[[], None], name: str) -> Callable[[], None]:
    """``step`` with DSelect-k forced onto one ATen formulation (the Triton kernels off)."""

    def run() -> None:
        with (
            mock.patch.dict(os.environ, {"DSELECTK_TRITON": "0"}),
            mock.patch.multiple(dispatch, **FORCED[name]),
        ):
            step()

    return run


def kernels_per_step(step: Callable[[], None], dev: torch.device) -> int:
    """Device kernels (CUDA) or ATen ops (CPU) one call of ``step`` launches."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    if dev.type == "cuda":
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def measure(dev: torch.device, reps: int, compiled: bool) -> list[dict[str, Any]]:
    rows = []
    for b in BATCHES:
        ours, theirs, gate, topk, x, g = gate_steps(b, dev)
        fns = {"topk": theirs, "dselect": ours}
        fns.update({f"dselect_{name}": forced(ours, name) for name in FORCED})
        if compiled:
            cg, ct = torch.compile(gate), torch.compile(topk)
            fns["dselect_compiled"] = fwd_bwd(partial(dselect_out, cg, x), g)
            fns["topk_compiled"] = fwd_bwd(partial(topk_out, ct, x), g)
        t = compare(fns, dev, reps=reps, warmup=3, shuffle=True)
        for name, step in fns.items():
            rows.append(
                {
                    "B": b,
                    "gate": name,
                    "median_ms": t[name]["median_ms"],
                    "topk_over_this": t["topk"]["median_ms"] / t[name]["median_ms"],
                    "kernels": kernels_per_step(step, dev),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    facts = machine_facts(dev)
    rows = measure(dev, args.reps, not args.no_compile)
    print(json.dumps(facts))
    print(f"{'B':>5} {'gate':<18} {'ms':>8} {'topk/this':>9} {'kernels':>7}")
    for r in rows:
        print(
            f"{r['B']:>5} {r['gate']:<18} {r['median_ms']:>8.3f} "
            f"{r['topk_over_this']:>9.2f} {r['kernels']:>7}"
        )
    if args.out:
        doc = {"machine": facts, "commit": os.environ.get("DSELECTK_COMMIT", ""), "rows": rows}
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
