"""Item ``small_batch``: DSelect-k vs Top-k at every batch size, threads, and beside busy processes.

Per-example gates, p = 64, n = 128, k = 4, forward + backward (float32), at B = 1, 16, 256, 4096
on 1 and 2 intra-op threads (as many as the CPU has), DSelect-k and Top-k timed interleaved in
one process (in a new random order each round: ``compare(shuffle=True)``). Ratio = Top-k /
DSelect-k (>= 1: DSelect-k at least as fast). A third column times the DSelect-k step wrapped
in ``dselectk.runtime.intra_op_threads(1)`` (what a user can do for small batches on a shared
machine).

Contention (on by default, ``--no-contention`` skips it): the same measurement on 2 threads in
``--contention-blocks`` blocks (default 3), each an idle half followed at once by a busy half
(3 processes that spin on the CPU, ``multiprocessing``, started and stopped around it), so that
each busy time has an idle time measured seconds before it, not minutes (the load of a shared
machine drifts between the two; a single idle and a single busy phase gave 1.7-3.7x for the same
code). A row gives the medians over the blocks of the idle and the busy medians, and the median
of the blocks' busy / idle ratios, with their range. A ``control`` row
per batch size times plain single-threaded NumPy work of the gate's size (exp and sum of a
(B, n) float32 array, 8 times) in the same rounds: its busy / idle is what this machine does to
any one-thread step beside the spinners (about 2 on 2 CPUs: four runnable threads), the
reference the gate's ratio is read against.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from functools import partial
from typing import Any

import numpy as np
import torch

from benchmarks.common import Report, dselect_out, fwd_bwd, load_average, topk_out
from benchmarks.timing import compare
from dselectk.gates import DSelectK, TopKGate
from dselectk.runtime import exit_with_parent, intra_op_threads

P, N, K = 64, 128, 4
BATCHES = (1, 16, 256, 4096)
BUSY_PROCESSES = 3
CONTENTION_BLOCKS = 3


def _spin(stop: Any, ready: Any, parent: int) -> None:  # pragma: no cover - a child process
    exit_with_parent(parent)  # never an orphan spinning on a shared machine (even after kill -9)
    ready.release()
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


class Busy:
    """Context manager: ``n`` processes spinning on the CPU while the block runs. They are
    stopped when the block ends (also on Ctrl-C or an error) and die with this process (Linux
    ``prctl``, even when it is killed); the block starts once all of them spin."""

    def __init__(self, n: int = BUSY_PROCESSES) -> None:
        self.n = n
        self.ctx = mp.get_context("spawn")
        self.stop = self.ctx.Event()
        self.ready = self.ctx.Semaphore(0)
        self.procs: list[Any] = []

    def __enter__(self) -> Busy:
        try:
            for _ in range(self.n):
                args = (self.stop, self.ready, os.getpid())
                proc = self.ctx.Process(target=_spin, args=args, daemon=True)
                proc.start()
                self.procs.append(proc)
            for _ in range(self.n):
                self.ready.acquire(timeout=60)
        except BaseException:
            self.__exit__()
            raise
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for proc in self.procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.procs.clear()


def _guarded(step: Any) -> Any:
    def run() -> None:
        with intra_op_threads(1):
            step()

    return run


def _control(a: np.ndarray) -> Any:
    """Single-threaded NumPy work on the gate's (B, n) size: the contention rows' reference."""

    def run() -> None:
        for _ in range(8):
            float(np.exp(a).sum())

    return run


def gate_steps(b: int, dev: torch.device) -> tuple[Any, Any, DSelectK, TopKGate, Any, Any]:
    """Seeded per-example DSelect-k and Top-k gates (p = P, n = N, k = K) on a batch of ``b``:
    (DSelect-k's fwd+bwd step, Top-k's, the two gates, the input, the output gradient)."""
    torch.manual_seed(0)
    x = torch.randn(b, P, device=dev)
    g = torch.randn(b, N, device=dev)
    gate = DSelectK(N, K, in_features=P, entropy_reg=0.1).to(dev)
    topk = TopKGate(N, K, in_features=P).to(dev)
    steps = fwd_bwd(partial(dselect_out, gate, x), g), fwd_bwd(partial(topk_out, topk, x), g)
    return *steps, gate, topk, x, g


def measure(
    batches: tuple[int, ...], threads: int, reps: int, dev: torch.device
) -> dict[int, dict[str, dict[str, float]]]:
    """B -> compare() timings of ``dselect``, ``topk``, ``dselect_1t`` and ``control`` on
    ``threads``."""
    out = {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in batches:
            ours, theirs, *_ = gate_steps(b, dev)
            fns = {
                "dselect": ours,
                "topk": theirs,
                "dselect_1t": _guarded(ours),
            }
            if dev.type == "cpu":
                fns["control"] = _control(np.random.default_rng(0).random((b, N), np.float32))
            n = reps if b < 4096 else max(3, reps // 3)
            out[b] = compare(fns, dev, reps=n, warmup=2, shuffle=True)
    finally:
        torch.set_num_threads(before)
    return out


def run(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    batches = tuple(getattr(args, "small_batches", None) or BATCHES)
    reps = getattr(args, "small_reps", 0) or (15 if args.quick else 40)
    cores = os.cpu_count() or 1
    thread_list = [t for t in (1, 2) if t <= max(cores, 1)] if dev.type == "cpu" else [1]
    rows = []
    idle: dict[int, dict[int, dict[str, dict[str, float]]]] = {}
    for threads in thread_list:
        load = load_average()
        idle[threads] = t = measure(batches, threads, reps, dev)
        for b in batches:
            d, tk, d1 = (t[b][name]["median_ms"] for name in ("dselect", "topk", "dselect_1t"))
            rows.append(
                {
                    "case": f"B={b} threads={threads}",
                    "ours_ms": d,
                    "base_ms": tk,
                    "ratio": tk / d,
                    "ours_1t_ms": d1,
                    "config": f"B={b} threads={threads} load={load}",
                    "B": b,
                    "threads": threads,
                    "load_avg_1m": load,
                }
            )
    rep.table(
        "small_batch",
        "per-example gate fwd+bwd, DSelect-k vs Top-k (p=64, n=128, k=4), ratio = topk/ours",
        rows,
        "target: ratio >= 1 at every B and threads; B = 4096 on 1 thread <= 5 ms",
    )
    if getattr(args, "no_contention", False) or dev.type != "cpu" or 2 not in idle:
        return
    blocks = getattr(args, "contention_blocks", 0) or CONTENTION_BLOCKS
    rep.table(
        "small_batch_contention",
        f"2 threads beside {BUSY_PROCESSES} busy processes, {blocks} blocks of idle then busy: "
        "ours ms = busy, base ms = idle (medians over the blocks), ratio = the blocks' median "
        "busy/idle (range in the config)",
        contention_rows(batches, max(3, reps // blocks), dev, blocks),
        "target: DSelect-k busy/idle <= 2.5 at every B",
    )


def contention_rows(
    batches: tuple[int, ...], reps: int, dev: torch.device, blocks: int
) -> list[dict[str, Any]]:
    """``blocks`` times: :func:`measure` on 2 threads idle, then beside :data:`BUSY_PROCESSES`
    spinning processes; one row per (B, function) with the medians over the blocks."""
    idle, busy, loads = [], [], []
    for _ in range(blocks):
        idle.append(measure(batches, 2, reps, dev))
        with Busy(BUSY_PROCESSES):
            loads.append(load_average())
            busy.append(measure(batches, 2, reps, dev))
    rows = []
    for b in batches:
        for name in ("dselect", "topk", "dselect_1t", "control"):
            i_ms = [blk[b][name]["median_ms"] for blk in idle]
            b_ms = [blk[b][name]["median_ms"] for blk in busy]
            ratios = [x / y for x, y in zip(b_ms, i_ms)]
            rows.append(
                {
                    "case": f"{name} B={b} busy/idle",
                    "ours_ms": statistics.median(b_ms),
                    "base_ms": statistics.median(i_ms),
                    "ratio": statistics.median(ratios),
                    "ratios": ratios,
                    "config": f"threads=2 busy={BUSY_PROCESSES} blocks={blocks} "
                    f"ratios={min(ratios):.2f}-{max(ratios):.2f} load={min(loads)}-{max(loads)}",
                    "B": b,
                    "gate": name,
                    "threads": 2,
                    "blocks": blocks,
                    "load_avg_1m": loads[0],
                }
            )
    return rows
