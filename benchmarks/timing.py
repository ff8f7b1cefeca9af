"""Timing and machine-fact helpers shared by the suite."""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch

from dselectk.runtime import tune_allocator

__all__ = ["compare", "machine_facts", "sync"]


def sync(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    reps: int = 20,
    warmup: int = 3,
    min_time: float = 0.0,
    shuffle: bool = False,
) -> dict[str, dict[str, float]]:
    """Time several callables interleaved (round robin), so that load changes hit all of them.

    Each round calls every function once; ``reps`` rounds are timed after ``warmup`` rounds (and
    more rounds while the total is below ``min_time`` seconds, up to 5 × reps). With
    ``shuffle``, each round calls them in a new random order (seeded, the same for every run):
    beside busy processes the scheduler preempts a process at a steady period, and a fixed order
    can lock onto it, so that one function takes most of the waits (seen: one of two equal
    functions 10x slower than the other in one run, the other way round in the next).

    Returns:
        name -> {"median_ms", "min_ms", "iqr_ms", "n"}.
    """
    for _ in range(warmup):
        for f in fns.values():
            f()
    sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns.items())
    rng = random.Random(0)
    start = time.perf_counter()
    rounds = 0
    while rounds < reps or (time.perf_counter() - start < min_time and rounds < 5 * reps):
        if shuffle:
            rng.shuffle(order)
        for name, f in order:
            sync(device)
            t0 = time.perf_counter()
            f()
            sync(device)
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    out = {}
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
        out[name] = {
            "median_ms": statistics.median(ts) * 1e3,
            "min_ms": min(ts) * 1e3,
            "iqr_ms": (q[2] - q[0]) * 1e3,
            "n": float(len(ts)),
        }
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_facts(device: torch.device) -> dict[str, object]:
    """CPU model, core and thread counts, torch/python versions, GPU name when used."""
    facts: dict[str, object] = {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "allocator_tuned": tune_allocator(),
    }
    try:
        facts["load_avg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    return facts
