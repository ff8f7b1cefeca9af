"""The cost of a real-data command, printed before ``--full`` starts and by ``--dry-run``: the
runs (tuning trials under ``--full``, then the final repetitions) and their training steps,
priced by a timed probe of each gate (:func:`probe`) in this process with ``--threads``
threads. The estimate is CPU time (probe time × threads); the wall time spreads the (setting,
gate) cells over the ``--jobs`` workers, largest first, as the runner does.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dselectk_research.realdata.spec import Experiment, RealDataConfig, Splits, label
from dselectk_research.realdata.train import train_one
from dselectk_research.runner import grid_points

#: training steps of the timed probe of each gate (after one warm-up step)
PROBE_STEPS = 30
#: the probe trains fewer steps when a step takes longer than PROBE_SECONDS / PROBE_STEPS
PROBE_SECONDS = 10.0
#: validation and test examples evaluated by the probe (to price each run's evaluation)
PROBE_EVAL = 2048


def repetitions(exp: Experiment, args: Any) -> int:
    """Final repetitions per (setting, gate): ``--repetitions``, else 100 (full) or quick's."""
    if args.repetitions is not None:
        return int(args.repetitions)
    return 100 if args.full else exp.quick_reps


def _epochs(exp: Experiment, args: Any, gate: str) -> tuple[float, int]:
    """(mean epochs of a tuning run, epochs of a final run) of ``gate``; under ``--full`` the
    final epochs are not known before tuning: the grid's mean is used."""
    if args.epochs is not None or not args.full:
        e = int(args.epochs or exp.quick_hparams[gate]["epochs"])
        return float(e), e
    mean = statistics.fmean(float(v) for v in exp.grid[gate]["epochs"])
    return mean, round(mean)


def probe(
    exp: Experiment, data: Splits, gates: Sequence[str], setting: Any, steps: int = PROBE_STEPS
) -> dict[str, dict[str, float]]:
    """gate → {"step_seconds", "eval_seconds_per_example"} (wall seconds of this process) of
    ``steps`` training steps (fewer for slow models) and a small evaluation."""

    def head(n_train: int, n_eval: int) -> Splits:  # the first examples of each split
        train = data.train.batch(torch.arange(min(len(data.train), n_train)))
        val, test = (d.batch(torch.arange(n_eval)) for d in (data.val, data.test))
        return Splits(train, val, test, data.meta, data.config)

    out: dict[str, dict[str, float]] = {}
    n_eval = min(PROBE_EVAL, len(data.val), len(data.test))
    for i, gate in enumerate(gates):
        hp = {**exp.quick_hparams[gate], "epochs": 1}
        if i == 0:  # warm-up (first-call costs of torch and the data path), not timed
            warm = head(2 * exp.batch_size, min(64, n_eval))
            m, _ = train_one(exp, gate, hp, setting, 0, warm, record_trajectory=False)
            per_step = float(m["train_seconds"]) / max(1, int(m["steps"]))
            # slow models (the CNN experts on a loaded machine): about PROBE_SECONDS per gate
            steps = max(3, min(steps, int(PROBE_SECONDS / max(per_step, 1e-6))))
            sub = head((steps + 1) * exp.batch_size, n_eval)
        t0 = time.perf_counter()
        m, _ = train_one(exp, gate, hp, setting, 0, sub, record_trajectory=False)
        wall = time.perf_counter() - t0
        train_s = float(m["train_seconds"])
        out[gate] = {
            "step_seconds": train_s / max(1, int(m["steps"])),
            "eval_seconds_per_example": max(0.0, wall - train_s) / max(1, 2 * n_eval),
        }
    return out


def estimate(
    exp: Experiment,
    args: Any,
    settings: Sequence[Any],
    n_train: int,
    n_eval: int,
    timing: Mapping[str, Mapping[str, float]],
    jobs: int,
    threads: int = 1,
) -> dict[str, Any]:
    """The plan's numbers: runs, steps per run, CPU seconds and the wall-time estimate."""
    per_epoch = math.ceil(n_train / exp.batch_size)
    reps = repetitions(exp, args)
    gates: dict[str, dict[str, Any]] = {}
    for gate in args.gates:
        tune_epochs, final_epochs = _epochs(exp, args, gate)
        tune_runs = 0
        if args.full:
            points = min(int(args.grid_points), len(grid_points(exp.grid[gate])))
            tune_runs = points * int(args.trials)
        t = timing[gate]
        run_eval = t["eval_seconds_per_example"] * n_eval
        final_s = reps * (final_epochs * per_epoch * t["step_seconds"] + run_eval)
        tune_s = tune_runs * (tune_epochs * per_epoch * t["step_seconds"] + run_eval)
        gates[gate] = {
            "tune_runs": tune_runs,
            "tune_steps_each": round(tune_epochs * per_epoch),
            "final_runs": reps,
            "final_steps_each": final_epochs * per_epoch,
            "step_ms": 1e3 * t["step_seconds"],
            "cell_seconds": (final_s + tune_s) * max(1, threads),
        }
    cells = sorted((gates[g]["cell_seconds"] for _ in settings for g in args.gates), reverse=True)
    loads = [0.0] * max(1, jobs)
    for c in cells:  # largest first onto the least-loaded worker, as the runner's pool does
        loads[loads.index(min(loads))] += c
    return {
        "gates": gates,
        "runs": sum(len(settings) * (g["tune_runs"] + g["final_runs"]) for g in gates.values()),
        "cpu_seconds": sum(cells),
        "wall_seconds": max(loads) / max(1, threads),
        "steps_per_epoch": per_epoch,
    }


def _hms(s: float) -> str:
    h, rem = divmod(round(s), 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def print_plan(
    exp: Experiment, args: RealDataConfig, data: Splits, jobs: int, threads: int = 0
) -> None:
    """Probe each gate, then print the plan of the command (``threads``: 0 is torch's)."""
    settings = args.settings
    threads = threads or torch.get_num_threads()
    timing = probe(exp, data, list(args.gates), settings[0])
    n_eval = len(data.val) + len(data.test)
    est = estimate(exp, args, settings, len(data.train), n_eval, timing, jobs, threads)
    lines = [
        f"Plan of `{exp.name}` ({'full' if args.full else 'quick'}; init {exp.init}, "
        f"optimizer {exp.optimizer} with {exp.optimizer_defaults} defaults): "
        f"{len(settings)} {exp.setting_key or 'setting'} value(s) × {len(args.gates)} gate(s), "
        f"{est['runs']} runs, {len(data.train):,} training examples = "
        f"{est['steps_per_epoch']:,} steps per epoch.",
        "| gate | tuning runs × steps | final runs × steps | probe ms/step |",
        "|---|---|---|---|",
    ]
    for g, v in est["gates"].items():
        lines.append(
            f"| {label(g)} | {v['tune_runs']} × {v['tune_steps_each']:,} | "
            f"{v['final_runs']} × {v['final_steps_each']:,} | {v['step_ms']:.1f} |"
        )
    lines.append(
        f"Estimated CPU time {_hms(est['cpu_seconds'])} ({est['cpu_seconds'] / 3600:.2f} "
        f"core-hours, probe: up to {PROBE_STEPS} steps per gate with {threads} thread(s) on this "
        f"machine as loaded now); wall time with --jobs {jobs} --threads {threads}: about "
        f"{_hms(est['wall_seconds'])} (data loading not included)."
    )
    print("\n".join(lines), flush=True)
