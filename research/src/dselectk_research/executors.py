"""Where a recipe's cells run: one protocol (:class:`Executor`), two implementations:
:class:`LocalExecutor` (``--executor local``: this process or a pool of worker processes) and
:class:`~dselectk_research.slurm.SlurmExecutor` (``--executor slurm``: one Slurm job per
cell, through submitit)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from dselectk.progress import tqdm
from dselectk_research.records import RunStore

#: ``on_cell(name, selection, run_ids)``: called by an executor once per finished cell
OnCell = Callable[[str, dict[str, Any], Iterable[str]], None]


@dataclass
class _WorkerState:
    """The state of one pool worker process: its progress-bar line, whether bars show, and the
    data it loaded (with the key it was loaded for)."""

    position: int
    progress: bool
    key: Any = None
    data: Any = None
    loaded: bool = False


#: this process's pool-worker state; None in the main process. A process-global because a
#: :class:`~concurrent.futures.ProcessPoolExecutor` initializer has no other way to hand state
#: to the tasks that later run in its process; only :func:`_worker_init` sets it, once per
#: spawned worker.
_STATE: _WorkerState | None = None


class Executor(Protocol):
    """Where a recipe's cells run: ``jobs`` worker processes, ``threads`` torch threads per
    process (0: torch's default), ``progress`` bars. :meth:`sized` resolves the worker count
    for a number of cells; :meth:`run` runs (or resumes) every cell of a recipe and calls
    ``on_cell`` once per finished cell."""

    @property
    def jobs(self) -> int: ...

    @property
    def threads(self) -> int: ...

    @property
    def progress(self) -> bool: ...

    def sized(self, cells: int) -> Executor: ...

    def run(self, recipe: Any, config: Any, out: Path, on_cell: OnCell) -> None: ...


def run_cell(
    recipe: Any, config: Any, cell: Any, data: Any, progress: bool
) -> tuple[str, dict[str, Any], set[str]]:
    """One cell, wherever it runs: its name, its selection and the runs it looked up or wrote
    (the cell gets a tracking :class:`~dselectk_research.records.RunStore` of ``config.out``)."""
    store = RunStore(config.out, track=True)
    selection = recipe.run_cell(config, cell, data, progress, store)
    assert store.tracked is not None
    return recipe.cell_name(cell), selection, store.tracked


@dataclass(frozen=True)
class LocalExecutor:
    """The cells on this machine: in this process (``jobs`` 1) or a spawned pool of ``jobs``
    workers (0: one per ``threads`` cores, at most one per cell, resolved by :meth:`sized`),
    largest cells first, each with its progress-bar line; the workers exit with the sweep's main
    process (``kill -9`` of the sweep stops it whole). ``threads`` 0 is torch's default in one
    process, an equal share of the cores in a pool."""

    jobs: int = 1
    threads: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.jobs < 0:
            raise ValueError(f"--jobs must be >= 0 (0: one per core), got {self.jobs}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0 (0: all cores), got {self.threads}")

    def sized(self, cells: int) -> LocalExecutor:
        if self.jobs:
            return self
        jobs = max(1, min(cells, torch.get_num_threads() // max(1, self.threads)))
        return dataclasses.replace(self, jobs=jobs)

    def run(self, recipe: Any, config: Any, out: Path, on_cell: OnCell) -> None:
        if self.jobs > 1 and len(recipe.cells) > 1:
            _run_pool(recipe, config, self.jobs, self.threads, self.progress, on_cell)
            return
        if self.threads:
            torch.set_num_threads(self.threads)
        data = recipe.load_data(config)
        for cell in recipe.cells:
            on_cell(*run_cell(recipe, config, cell, data, self.progress))


# -- the local pool ---------------------------------------------------------------------------
def progress_position() -> int | None:
    """The progress-bar line of this worker process (None in the main process)."""
    return None if _STATE is None else _STATE.position


class _SweepKilled(BaseException):
    """Raised in a pool worker by SIGTERM (its parent died): unwinds so that a record being
    written removes its temp file (see :mod:`dselectk.io`), then the worker exits."""


def _raise_sweep_killed(signum: int, frame: Any) -> None:
    raise _SweepKilled


def _worker_init(threads: int, parent_pid: int, counter: Any, lock: Any, progress: bool) -> None:
    """Pool worker set-up: its share of the cores, the allocator settings of the CLI, exit
    when the sweep's main process dies, and its own progress-bar line (tqdm's lock)."""
    from dselectk.runtime import exit_with_parent, tune_allocator

    global _STATE
    signal.signal(signal.SIGTERM, _raise_sweep_killed)
    exit_with_parent(parent_pid)
    torch.set_num_threads(threads)
    tune_allocator()
    with counter.get_lock():
        position = int(counter.value) + 1
        counter.value += 1
    _STATE = _WorkerState(position, progress)
    tqdm.set_lock(lock)


def _worker_cell(
    recipe: Any, config: Any, cell: Any
) -> tuple[str, dict[str, Any], set[str], float]:
    """One cell in a pool worker (the data is loaded once per worker)."""
    t0 = time.perf_counter()
    state = _STATE
    assert state is not None, "a pool task runs in a process set up by _worker_init"
    try:
        key = recipe.data_key(config)
        if not state.loaded or state.key != key:
            state.data, state.key, state.loaded = recipe.load_data(config), key, True
        result = run_cell(recipe, config, cell, state.data, state.progress)
    except _SweepKilled:
        os._exit(1)  # the sweep is gone: nothing to report to, nothing half-written left
    return (*result, time.perf_counter() - t0)


def _run_pool(
    recipe: Any, config: Any, jobs: int, threads: int, progress: bool, on_cell: OnCell
) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    threads = threads or max(1, torch.get_num_threads() // jobs)
    cost = recipe.cost
    order = list(recipe.cells) if cost is None else sorted(recipe.cells, key=lambda c: -cost(c))
    ctx = mp.get_context("spawn")
    lock = ctx.RLock()
    tqdm.set_lock(lock)
    init = (threads, os.getpid(), ctx.Value("i", 0), lock, progress)
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init, initargs=init) as pool:
        futures = [pool.submit(_worker_cell, recipe, config, c) for c in order]
        bar = tqdm(total=len(futures), disable=not progress, desc=f"cells ({jobs} processes)")
        try:
            for fut in as_completed(futures):
                key, selection, cell_runs, seconds = fut.result()
                on_cell(key, selection, cell_runs)
                bar.set_postfix_str(f"{key} {seconds:.0f}s")
                bar.update(1)
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
        finally:
            bar.close()
