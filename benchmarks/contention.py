"""Item ``contention``: the gate step and a small MMoE training step, idle and beside busy CPUs.

In one run, for the per-example DSelect-k gate's forward + backward (p = 64, n = 128, k = 4,
float32) at B = 1, 16, 256, 4096 and for a small MMoE training step (8 Dense-256 experts on 64
features, a static DSelect-k bank of 2 gates with k = 2, towers 256 -> 1, batch 128, Adam), two
ways of running the step, timed interleaved in the same rounds (in a new random order each
round):

- ``2 threads``: the step as a user writes it, on torch's intra-op pool of 2 threads (the
  default of a 2-core machine);
- ``policy``: the step inside :func:`dselectk.runtime.thread_policy` with the step's work (what
  :func:`~dselectk.training.train` does with ``TrainConfig(threads="auto")``: one intra-op
  thread below :data:`dselectk.runtime.PARALLEL_MIN_WORK`, else the threads the process gets).

The machine is measured in ``--contention-blocks`` blocks (default 3), each an idle half then a
busy half beside :data:`BUSY_PROCESSES` processes that spin on the CPU (started here, stopped at
the end of each half, also on Ctrl-C or an error), so that each busy time has an idle time
measured seconds before it. A row: the busy median (ours ms), the idle median (base ms), and the
median over the blocks of busy / idle (ratio), with the range in the config. A ``control`` row per
size times plain single-threaded NumPy work (what the spinners do to any one-thread step: about
2 on 2 CPUs with 4 runnable threads), the reference the other ratios are read against.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from benchmarks.common import Report, dselect_out, fwd_bwd, load_average
from benchmarks.mmoe import adam, ours_mmoe, train_step
from benchmarks.small_batch import BUSY_PROCESSES, Busy
from benchmarks.timing import compare
from dselectk.gates import DSelectK
from dselectk.runtime import thread_policy

__all__ = ["BATCHES", "run"]

P, N, K = 64, 128, 4
BATCHES = (1, 16, 256, 4096)
MMOE_BATCH = 128
BLOCKS = 3
THREADS = 2

Step = Callable[[], object]


def _control(size: int) -> Step:
    a = np.random.default_rng(0).random((max(size, 1), N), np.float32)

    def run() -> None:
        for _ in range(8):
            float(np.exp(a).sum())

    return run


def _with_policy(step: Step, work: int) -> Step:
    def run() -> None:
        with thread_policy(work):
            step()

    return run


def _gate_case(b: int) -> dict[str, Step]:
    torch.manual_seed(0)
    x = torch.randn(b, P)
    g = torch.randn(b, N)
    gate = DSelectK(N, K, in_features=P, entropy_reg=0.1)
    step = fwd_bwd(partial(dselect_out, gate, x), g)
    work = b * sum(p.numel() for p in gate.parameters())
    return {"2 threads": step, "policy": _with_policy(step, work), "control": _control(b)}


def _mmoe_case() -> dict[str, Step]:
    torch.manual_seed(1)
    x = torch.randn(MMOE_BATCH, 64)
    ys = [torch.randn(MMOE_BATCH, 1) for _ in range(2)]
    model = ours_mmoe(torch.device("cpu"))
    step = train_step(model, adam(model.parameters(), torch.device("cpu")), x, ys)
    work = MMOE_BATCH * sum(p.numel() for p in model.parameters() if p.requires_grad)
    # the control of the B = 4096 gate (a few ms of one-thread NumPy work, like the step idle)
    return {"2 threads": step, "policy": _with_policy(step, work), "control": _control(4096)}


def cases(batches: tuple[int, ...]) -> dict[str, dict[str, Step]]:
    """Case name -> {way of running: step}."""
    out = {f"gate B={b}": _gate_case(b) for b in batches}
    out[f"mmoe step B={MMOE_BATCH}"] = _mmoe_case()
    return out


def measure(steps: dict[str, dict[str, Step]], reps: int) -> dict[str, dict[str, float]]:
    """(case, way) -> median ms, on :data:`THREADS` intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    out: dict[str, dict[str, float]] = {}
    try:
        for case, fns in steps.items():
            n = reps if "4096" not in case else max(3, reps // 3)
            t = compare(fns, torch.device("cpu"), reps=n, warmup=2, shuffle=True)
            out[case] = {way: t[way]["median_ms"] for way in fns}
    finally:
        torch.set_num_threads(before)
    return out


def run(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    if dev.type != "cpu":
        print("contention: CPU only, skipped")
        return
    batches = tuple(getattr(args, "small_batches", None) or BATCHES)
    blocks = getattr(args, "contention_blocks", 0) or BLOCKS
    reps = getattr(args, "small_reps", 0) or (10 if args.quick else 24)
    steps = cases(batches)
    idle, busy, loads = [], [], []
    for _ in range(blocks):
        loads.append(load_average())
        idle.append(measure(steps, reps))
        with Busy(BUSY_PROCESSES):
            busy.append(measure(steps, reps))
            loads.append(load_average())
    rows = []
    for case, fns in steps.items():
        for way in fns:
            i_ms = [blk[case][way] for blk in idle]
            b_ms = [blk[case][way] for blk in busy]
            ratios = [x / y for x, y in zip(b_ms, i_ms)]
            rows.append(
                {
                    "case": f"{case} {way}",
                    "ours_ms": statistics.median(b_ms),
                    "base_ms": statistics.median(i_ms),
                    "ratio": statistics.median(ratios),
                    "ratios": ratios,
                    "config": f"threads={THREADS} busy={BUSY_PROCESSES} blocks={blocks} "
                    f"ratios={min(ratios):.2f}-{max(ratios):.2f} "
                    f"load={min(loads)}-{max(loads)}",
                    "way": way,
                    "threads": THREADS,
                    "blocks": blocks,
                    "load_avg_1m": loads,
                }
            )
    rep.table(
        "contention",
        f"beside {BUSY_PROCESSES} busy processes, {THREADS} threads vs the thread policy: "
        "ours ms = busy, base ms = idle (medians over the blocks), ratio = median busy/idle",
        rows,
        "target: policy busy/idle <= 2.5 for the gate at every B and for the MMoE step",
    )
