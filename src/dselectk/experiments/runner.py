"""The one runner of every experiment: cells of a sweep, resumed from their records, in a pool.

An experiment (a *recipe*) describes its sweep as a :class:`Sweep`: a list of cells (e.g. one
(gate, T) pair of the synthetic study), a function that loads the data once per process, and a
function that runs one cell — select its hyperparameters (the shipped selection, or a random
grid search whose trials are records too), then train the missing repetitions and save one
record per run. The runner owns everything else:

* **resume** — a record is written atomically when its run finishes, and a cell skips the runs
  whose records exist (:func:`missing`), so a sweep killed by Ctrl-C or ``kill -9`` continues
  where it stopped when the same command runs again;
* **worker pool** — with ``jobs > 1`` the cells run in spawned processes, largest first, each
  with its share of the cores and its own progress-bar line; workers exit with the sweep's main
  process (``kill -9`` of the sweep stops it whole);
* **executors** — ``--executor local`` (the above) or ``--executor slurm`` (one Slurm job per
  cell through submitit, resumable and re-attachable; see :mod:`dselectk.experiments.executors`),
  flags added by :func:`add_executor_arguments`;
* **selections** — ``selected_hparams.json`` is rewritten as cells finish (cell order);
* **grid search** helpers — :func:`grid_points`, :func:`sample_points`.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dselectk.experiments.args import check_out_dir
from dselectk.experiments.executors import (
    SweepDetached,
    add_executor_arguments,
    executor_from_args,
    run_slurm,
)
from dselectk.experiments.records import RunStore, tracking
from dselectk.io import write_json
from dselectk.progress import tqdm

__all__ = [
    "Sweep",
    "SweepDetached",
    "add_executor_arguments",
    "cell_str",
    "executor_from_args",
    "grid_points",
    "missing",
    "progress_position",
    "resolve_jobs",
    "run_recipe",
    "run_sweep",
    "sample_points",
]

#: state of a pool worker process (its data, progress-bar line); empty in the main process
_WORKER: dict[str, Any] = {}


@dataclass(frozen=True)
class Sweep:
    """A recipe's sweep, as the runner needs it.

    The functions must be module-level (they are sent to spawned worker processes).

    Attributes:
        cells: the cells, in report order.
        run_cell: ``(args, cell, data, progress) -> selection``; trains the cell's missing runs
            (one record each) and returns the hyperparameter selection of the cell (a JSON
            object for ``selected_hparams.json``).
        load_data: ``args -> data``, called once per process (and again only when
            ``data_key(args)`` changes).
        data_key: ``args -> key`` identifying the data.
        cell_name: ``cell -> "gate/T"``-like key of ``selected_hparams.json``.
        cost: ``cell -> number``; the pool starts the most expensive cells first (None: in
            cell order).
    """

    cells: Sequence[Hashable]
    run_cell: Callable[[Any, Any, Any, bool], dict[str, Any]]
    load_data: Callable[[Any], Any]
    data_key: Callable[[Any], Hashable]
    cell_name: Callable[[Any], str]
    cost: Callable[[Any], float] | None = None


def cell_str(cell: Any) -> str:
    """The cell's name when the cell is a plain name (a gate, a router)."""
    return str(cell)


# -- grid search --------------------------------------------------------------------------------
def grid_points(axes: Mapping[str, Sequence[Any]], *, sort_keys: bool = False) -> list[dict]:
    """Every point of a grid: the product of its axes (in ``axes`` order, or sorted keys)."""
    keys = sorted(axes) if sort_keys else list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(axes[k] for k in keys))]


def sample_points(points: Sequence[dict], limit: int | None, seed: str) -> list[dict]:
    """Random grid search: ``limit`` points drawn without replacement by a RNG seeded with
    ``seed`` (all points when ``limit`` is None or not smaller than their number)."""
    if limit is None or limit >= len(points):
        return list(points)
    return random.Random(seed).sample(list(points), limit)


def missing(store: RunStore, configs: Iterable[Mapping[str, Any]]) -> list[int]:
    """Indices of the configs whose records are not in ``store`` yet."""
    return [i for i, c in enumerate(configs) if not store.done(c)]


# -- the pool -------------------------------------------------------------------------------------
def progress_position() -> int | None:
    """The progress-bar line of this worker process (None in the main process)."""
    return _WORKER.get("position")


def resolve_jobs(jobs: int, threads: int, cells: int) -> int:
    """Worker processes: ``jobs``, or with 0 one per ``threads`` cores, at most one per cell."""
    if jobs < 0:
        raise ValueError(f"--jobs must be >= 0 (0: one per core), got {jobs}")
    if threads < 0:
        raise ValueError(f"--threads must be >= 0 (0: all cores), got {threads}")
    if jobs == 0:
        jobs = max(1, min(cells, torch.get_num_threads() // max(1, threads)))
    return jobs


class _SweepKilled(BaseException):
    """Raised in a pool worker by SIGTERM (its parent died): unwinds so that a record being
    written removes its temp file (see :mod:`dselectk.io`), then the worker exits."""


def _raise_sweep_killed(signum: int, frame: Any) -> None:
    raise _SweepKilled


def _worker_init(threads: int, parent_pid: int, counter: Any, lock: Any, progress: bool) -> None:
    """Pool worker set-up: its share of the cores, the allocator settings of the CLI, exit
    when the sweep's main process dies, and its own progress-bar line (tqdm's lock)."""
    from dselectk.runtime import exit_with_parent, tune_allocator

    signal.signal(signal.SIGTERM, _raise_sweep_killed)
    exit_with_parent(parent_pid)
    torch.set_num_threads(threads)
    tune_allocator()
    with counter.get_lock():
        _WORKER["position"] = int(counter.value) + 1
        counter.value += 1
    _WORKER["progress"] = progress
    tqdm.set_lock(lock)


def _load(sweep: Sweep, args: Any) -> Any:
    key = sweep.data_key(args)
    if _WORKER.get("key") != key or "data" not in _WORKER:
        _WORKER["data"] = sweep.load_data(args)
        _WORKER["key"] = key
    return _WORKER["data"]


def _worker_cell(sweep: Sweep, args: Any, cell: Any) -> tuple[str, dict[str, Any], float, set[str]]:
    """One cell in a pool worker (the data is loaded once per worker)."""
    t0 = time.perf_counter()
    try:
        with tracking() as runs:
            selection = sweep.run_cell(args, cell, _load(sweep, args), _WORKER["progress"])
    except _SweepKilled:
        os._exit(1)  # the sweep is gone: nothing to report to, nothing half-written left
    return sweep.cell_name(cell), selection, time.perf_counter() - t0, runs


def _run_pool(
    sweep: Sweep,
    args: Any,
    jobs: int,
    threads: int,
    progress: bool,
    save: Callable[[], None],
    runs: set[str],
) -> dict[str, Any]:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    threads = threads or max(1, torch.get_num_threads() // jobs)
    cost = sweep.cost
    order = list(sweep.cells) if cost is None else sorted(sweep.cells, key=lambda c: -cost(c))
    selected: dict[str, Any] = {}
    ctx = mp.get_context("spawn")
    lock = ctx.RLock()
    tqdm.set_lock(lock)
    init = (threads, os.getpid(), ctx.Value("i", 0), lock, progress)
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init, initargs=init) as pool:
        futures = [pool.submit(_worker_cell, sweep, args, c) for c in order]
        bar = tqdm(total=len(futures), disable=not progress, desc=f"cells ({jobs} processes)")
        try:
            for fut in as_completed(futures):
                key, selection, seconds, cell_runs = fut.result()
                selected[key] = selection
                runs.update(cell_runs)
                save()
                bar.set_postfix_str(f"{key} {seconds:.0f}s")
                bar.update(1)
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
        finally:
            bar.close()
    return selected


def run_sweep(
    sweep: Sweep,
    args: Any,
    out: str | Path,
    *,
    jobs: int = 1,
    threads: int = 0,
    progress: bool = True,
    command: str = "",
) -> dict[str, Any]:
    """Run (or resume) every cell; return the selections by cell name, in cell order.

    When every cell has run, ``plan.json`` lists the runs of this command (records looked up or
    written by its cells), so the reports summarise them only, never records of earlier
    commands with other settings (see :meth:`RunStore.load_planned`).

    Args:
        sweep: the recipe's sweep.
        args: the parsed command line, passed to the sweep's functions (picklable).
        out: results folder; ``selected_hparams.json`` is (re)written there as cells finish.
        jobs: worker processes (see :func:`resolve_jobs`); 1 runs the cells in this process.
        threads: torch threads of each process (0: torch's default in one process, an equal
            share of the cores in a pool).
        progress: show progress bars.
        command: the command line, recorded in ``plan.json``.

    ``args.executor == "slurm"`` (see :func:`add_executor_arguments`) runs the cells as Slurm
    jobs instead (``jobs`` is then unused); it raises :class:`SweepDetached` when the driver
    stops waiting (the jobs keep running; the same command again re-attaches).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "selected_hparams.json"
    names = [sweep.cell_name(c) for c in sweep.cells]
    selected: dict[str, Any] = {}

    def save() -> None:
        write_json(path, {n: selected[n] for n in names if n in selected})

    runs: set[str] = set()
    slurm = executor_from_args(args)
    if slurm is not None:

        def on_cell(name: str, selection: dict[str, Any], cell_runs: list[str]) -> None:
            selected[name] = selection
            runs.update(cell_runs)
            save()

        run_slurm(sweep, args, out, slurm, progress=progress, on_cell=on_cell)
    elif jobs > 1 and len(sweep.cells) > 1:
        selected.update(_run_pool(sweep, args, jobs, threads, progress, save, runs))
    else:
        if threads:
            torch.set_num_threads(threads)
        data = sweep.load_data(args)
        for cell, name in zip(sweep.cells, names):
            with tracking() as cell_runs:
                selected[name] = sweep.run_cell(args, cell, data, progress)
            runs.update(cell_runs)
            save()
    save()
    RunStore(out).write_plan(runs, command)
    return {n: selected[n] for n in names}


def run_recipe(
    sweep: Sweep,
    args: Any,
    *,
    threads: int,
    write_report: Callable[..., None],
    print_table: Callable[[Mapping[str, Any]], None],
    report_jobs: bool = False,
    prepare: Callable[[Path, int], bool] | None = None,
) -> int:
    """The ``run`` of a recipe: check ``--out`` up front, resolve ``--jobs``, run (or resume)
    the sweep, rebuild the report and print its table. Returns the exit code (0).

    Args:
        sweep: the recipe's sweep for ``args``.
        args: the parsed command line (``out``, ``jobs``, ``no_progress``, executor flags).
        threads: torch threads of each process (0: torch's default / an equal share).
        write_report: ``(out, wall_seconds=, command=[, jobs=, threads=])``.
        print_table: prints the one-screen table of ``summary.json``.
        report_jobs: also pass ``jobs`` and ``threads`` to ``write_report``.
        prepare: called with (out, jobs) once both are resolved, before the sweep (load and
            check data, print a plan); returning False stops there with exit code 0 (a dry
            run).
    """
    out = check_out_dir(args.out)
    jobs = resolve_jobs(int(getattr(args, "jobs", 1)), threads, len(sweep.cells))
    args.jobs = jobs
    if prepare is not None and not prepare(out, jobs):
        return 0
    command = " ".join(["dselectk", *sys.argv[1:]])
    t0 = time.perf_counter()
    progress = not args.no_progress
    run_sweep(sweep, args, out, jobs=jobs, threads=threads, progress=progress, command=command)
    wall = time.perf_counter() - t0
    extra = {"jobs": jobs, "threads": threads} if report_jobs else {}
    write_report(out, wall_seconds=wall, command=command, **extra)
    print_table(json.loads((out / "summary.json").read_text(encoding="utf-8")))
    print(f"\nwall time {wall:.0f}s; report: {out / 'report.md'}")
    return 0
