"""Benchmark: the Appendix C.1 protocol's training cost, batched vs one at a time.

Reports, in one run:

* the wall time of ``--steps`` training steps for N repetitions as one vectorized model and for
  the same N repetitions one after the other (same code path, R = 1), and their ratio;
* the per-step time of the fused loss (``_MixtureSSE``, the path training uses) against the
  same batched model with the loss composed from autograd ops (``reference_loss``);
* an estimate of the full C.1 protocol's final phase on this machine: gates × task counts ×
  100 repetitions, 391 steps per epoch, repetitions in chunks of ``--chunk``, from per-step
  times measured here. Epochs per cell: ``--full-epochs`` (default 100, the largest of the
  paper's grid, an upper bound) or each cell's tuned hyperparameters and epochs from a run's
  ``selected_hparams.json`` (``--selected``). With ``--jobs N`` the cells are timed in N
  processes at once (cores split between them, as ``dselectk reproduce synthetic --jobs N``
  runs them) and the estimate is the busiest process's total.

    .venv/bin/python -m benchmarks.bench_synthetic            # about 1-3 minutes on 2 cores
    .venv/bin/python -m benchmarks.bench_synthetic --threads 2 --jobs 2 \
        --gates dselect_k topk ablation_annealing ablation_entropy \
        --selected benchmarks/results/c1_full_selected_hparams.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import platform
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.synthetic_reference import reference_loss, train_step
from dselectk.models import MoEBank
from dselectk.runtime import tune_allocator
from dselectk_research import synthetic as S

STEPS_PER_EPOCH = math.ceil(100_000 / S.BATCH_SIZE)  # the paper's 100k training rows


def time_steps(
    gate: str,
    tasks: int,
    seeds: list[int],
    data: S.SyntheticData,
    steps: int,
    loss_fn: Callable[[MoEBank, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    hp: dict[str, Any] | None = None,
) -> float:
    """Seconds for ``steps`` training steps of one batched model over ``seeds`` (after warm-up),
    with ``hp`` (default: the shipped tuning record's) and its schedules over ``hp["epochs"]``."""
    if hp is None:
        hp = S.resolve_hparams(gate, tasks, S.load_tuned(), {})
    model = S.build_model(gate, tasks, hp, seeds)
    opt = torch.optim.Adam(model.parameters(), lr=float(hp["lr"]), foreach=True)
    scheds = S.VARIANTS[gate].schedulers(model.gates, hp, int(hp["epochs"]) * STEPS_PER_EPOCH)
    gen = torch.Generator().manual_seed(0)
    x, y = data.x_train, data.y_train[:, :tasks]
    idx = [torch.randint(0, x.shape[0], (S.BATCH_SIZE,), generator=gen) for _ in range(steps + 3)]
    for i in idx[:3]:
        train_step(model, opt, x[i], y[i], scheds, loss_fn)
    t0 = time.perf_counter()
    for i in idx[3:]:
        train_step(model, opt, x[i], y[i], scheds, loss_fn)
    return time.perf_counter() - t0


def _cell_hparams(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Hyperparameters per ``gate/T``: a run's selections (``--selected``, its tuned lr, γ, λ,
    temperatures and epochs) or the shipped tuning record with ``--full-epochs`` epochs."""
    tuned = S.load_tuned(args.selected) if args.selected is not None else S.load_tuned()
    out = {}
    for g in args.gates:
        for t in (16, 32, 64, 128):
            if args.selected is not None and str(t) not in tuned["hparams"].get(g, {}):
                raise SystemExit(f"--selected {args.selected}: no selection for {g}/{t}")
            hp = S.resolve_hparams(g, t, tuned, {})
            if args.selected is None:
                hp["epochs"] = args.full_epochs
            out[f"{g}/{t}"] = hp
    return out


_DATA: list[S.SyntheticData] = []


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)
    tune_allocator()


def _cell_step_s(
    cell: tuple[str, int],
    hp: dict[str, Any],
    chunk: int,
    steps: int,
    data: S.SyntheticData | None = None,
) -> float:
    """Seconds per training step of one cell's batched model of ``chunk`` repetitions."""
    if data is None:
        if not _DATA:
            _DATA.append(S.generate_data(0, n_train=20_000, n_val=10, n_test=10))
        data = _DATA[0]
    gate, t = cell
    return time_steps(gate, t, list(range(chunk)), data, steps, hp=hp) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=10, help="N repetitions compared")
    p.add_argument("--tasks", type=int, default=128)
    p.add_argument("--gate", default="dselect_k")
    p.add_argument("--steps", type=int, default=40, help="steps timed per configuration")
    p.add_argument("--chunk", type=int, default=100, help="repetitions per batched model (full)")
    p.add_argument("--full-reps", type=int, default=100)
    p.add_argument(
        "--full-epochs",
        type=int,
        default=100,
        help="epochs per final run in the estimate (100 = the largest of the paper's grid)",
    )
    p.add_argument("--gates", nargs="+", default=S.DEFAULT_GATES)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (the CLI's --threads, default 1)"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="processes for the estimate, as the CLI's --jobs (cells timed concurrently, "
        "cores split between them)",
    )
    p.add_argument(
        "--selected",
        type=Path,
        default=None,
        help="a run's selected_hparams.json: time each cell with its tuned settings and epochs",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = p.parse_args()
    tune_allocator()
    torch.set_num_threads(args.threads)
    data = S.generate_data(0, n_train=20_000, n_val=10, n_test=10)
    seeds = list(range(args.reps))
    batched = time_steps(args.gate, args.tasks, seeds, data, args.steps)
    sequential = sum(time_steps(args.gate, args.tasks, [s], data, args.steps) for s in seeds)
    print(
        f"machine: {platform.processor() or platform.machine()}, torch threads "
        f"{torch.get_num_threads()}, torch {torch.__version__}"
    )
    print(f"{args.gate}, T = {args.tasks}, {args.steps} steps, N = {args.reps} repetitions")
    print(f"  batched (one model)   : {batched:8.2f} s")
    print(f"  one at a time         : {sequential:8.2f} s")
    print(f"  speed-up              : {sequential / batched:8.2f} x")
    fused = time_steps(args.gate, args.tasks, seeds, data, args.steps)
    composed = time_steps(args.gate, args.tasks, seeds, data, args.steps, reference_loss)
    print(f"  batched, fused loss   : {fused:8.2f} s")
    print(f"  batched, autograd loss: {composed:8.2f} s")
    print(f"  speed-up (fused)      : {composed / fused:8.2f} x")
    # full protocol estimate
    hps = _cell_hparams(args)
    cells = sorted(((g, t) for g in args.gates for t in (16, 32, 64, 128)), key=lambda c: -c[1])
    n_steps = max(5, args.steps // 4)
    if args.jobs > 1:
        threads = max(1, torch.get_num_threads() // args.jobs)
        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(
            args.jobs, mp_context=ctx, initializer=_worker_init, initargs=(threads,)
        ) as pool:
            step_s = list(
                pool.map(
                    _cell_step_s,
                    cells,
                    [hps[f"{g}/{t}"] for g, t in cells],
                    [args.chunk] * len(cells),
                    [n_steps] * len(cells),
                )
            )
    else:
        step_s = [_cell_step_s(c, hps[f"{c[0]}/{c[1]}"], args.chunk, n_steps, data) for c in cells]
    chunks = math.ceil(args.full_reps / args.chunk)
    rows = []
    for (gate, t), per_step in sorted(
        zip(cells, step_s), key=lambda r: (args.gates.index(r[0][0]), r[0][1])
    ):
        ep = int(hps[f"{gate}/{t}"]["epochs"])
        secs = chunks * ep * STEPS_PER_EPOCH * per_step
        rows.append({"gate": gate, "T": t, "epochs": ep, "step_s": per_step, "est_s": secs})
        print(
            f"  full protocol {gate:<20} T={t:<4} {ep:>4} epochs: "
            f"{per_step * 1e3:6.1f} ms/step for {args.chunk} reps -> {secs / 60:6.1f} min"
        )
    # cells go to the least-loaded of the --jobs processes, largest T first (as the CLI does)
    load = [0.0] * args.jobs
    for r in sorted(rows, key=lambda r: -r["T"]):
        load[load.index(min(load))] += r["est_s"]
    total = max(load)
    print(
        f"estimated full C.1 protocol ({len(args.gates)} gates x 4 task counts x "
        f"{args.full_reps} reps, training only, after tuning, {args.jobs} process(es), "
        f"epochs: {args.selected or args.full_epochs}): {total / 3600:.2f} h"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "batched_s": batched,
                    "sequential_s": sequential,
                    "ratio": sequential / batched,
                    "fused_s": fused,
                    "composed_s": composed,
                    "fused_ratio": composed / fused,
                    "threads": torch.get_num_threads(),
                    "jobs": args.jobs,
                    "epochs_from": str(args.selected or args.full_epochs),
                    "full_estimate_s": total,
                    "rows": rows,
                }
            )
        )


if __name__ == "__main__":
    main()
