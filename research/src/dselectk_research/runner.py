"""The one runner of every experiment: a recipe's cells (:class:`Recipe`), resumed from their
records (a cell skips the runs whose records exist, :func:`missing`, so a killed sweep continues
where it stopped), run by an executor (:mod:`dselectk_research.executors`). Every function of
a recipe receives its **run config**: a frozen dataclass of the settings that decide what is
computed (never the argparse ``Namespace``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import itertools
import json
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dselectk.io import write_json, write_text
from dselectk.kernels import warm_kernels
from dselectk_research.args import check_out_dir, int_at_least, out_dir
from dselectk_research.executors import Executor, LocalExecutor
from dselectk_research.records import (
    PLAN_FILE,
    SWEEP_FILE,
    RunStore,
    load_records,
    read_object,
    read_record,
    record_experiment,
)
from dselectk_research.slurm import SlurmExecutor, add_executor_arguments, slurm_options


@dataclass(frozen=True)
class Recipe:
    """An experiment, as the runner and the executors need it. The functions must be
    module-level (they go to spawned workers and Slurm jobs); ``config`` is the run config.

    Attributes:
        cells: the cells, in report order.
        run_cell: ``(config, cell, data, progress, store) -> selection``: trains the cell's
            missing runs (one record each, looked up and written through ``store``, a
            :class:`~dselectk_research.records.RunStore` of ``config.out`` that tracks them);
            the selection is its entry of ``selected_hparams.json``.
        load_data: ``config -> data``, once per process (again when ``data_key`` changes).
        data_key: ``config -> key`` identifying the data.
        cell_name: ``cell -> name``, the cell's key in ``selected_hparams.json``.
        cost: ``cell -> number``: a pool starts the costliest cells first (None: cell order).
        write_report: ``(out, wall_seconds=, command=)`` (with ``report_jobs`` also ``jobs=``,
            ``threads=``): rebuilds the report from the records.
        print_table: prints the one-screen table of ``summary.json``.
        prepare: ``(out, executor) -> bool``, before the sweep (check data, print a plan);
            False stops there with exit code 0 (a dry run).
        diverged: ``summary -> message | None`` naming diverged runs: then the exit code is 1.
        planned_runs: ``(config, cell) -> int``, the final runs of a cell (for partial reports).
        experiment: the name its records carry: a folder holding another experiment's records
            is refused before any work (its report would be overwritten).
    """

    cells: Sequence[Hashable]
    run_cell: Callable[[Any, Any, Any, bool, RunStore], dict[str, Any]]
    load_data: Callable[[Any], Any]
    data_key: Callable[[Any], Hashable]
    cell_name: Callable[[Any], str]
    cost: Callable[[Any], float] | None = None
    write_report: Callable[..., None] | None = None
    print_table: Callable[[Mapping[str, Any]], None] | None = None
    report_jobs: bool = False
    prepare: Callable[[Path, Executor], bool] | None = None
    diverged: Callable[[Mapping[str, Any]], str | None] | None = None
    planned_runs: Callable[[Any, Any], int] | None = None
    experiment: str = ""


def add_run_arguments(
    p: argparse.ArgumentParser, *, out: str, threads: int = 1, jobs: int = 0, cells: str = "cells"
) -> None:
    """The flags every recipe shares, with its defaults: ``--out``, ``--threads`` (0 is
    allowed only when it is the default: a recipe of tiny models refuses it), ``--jobs``,
    ``--no-progress``, ``--telemetry`` and the executor's; ``cells`` names a cell in the help."""
    p.add_argument("--out", type=out_dir, default=Path(out), help="results folder")
    p.add_argument(
        "--threads",
        type=int_at_least(0 if threads == 0 else 1),
        default=threads,
        help="torch threads per process" + ("" if threads else " (default: 0, all cores)"),
    )
    p.add_argument(
        "--jobs",
        type=int_at_least(0),
        default=jobs,
        help=f"worker processes, each running whole {cells} (0: one per --threads cores, at "
        "most one per cell); the records are the same as in one process",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument(
        "--telemetry",
        action="store_true",
        help="log routing telemetry of every run to OUT/telemetry/ (TensorBoard if installed, "
        "else JSON lines): binary selections, experts per input, load, selector collisions",
    )
    add_executor_arguments(p)


def executor_from_args(args: argparse.Namespace, *, threads: int = 0) -> Executor:
    """The executor the flags choose (``--executor``, ``--jobs``, ``--no-progress``, the
    ``--slurm-*`` flags); ``threads`` is the recipe's torch threads per process."""
    progress = not getattr(args, "no_progress", False)
    if (opts := slurm_options(args)) is not None:
        return SlurmExecutor(opts, progress)
    return LocalExecutor(int(getattr(args, "jobs", 1)), int(threads), progress)


def check_config(config: Any) -> None:
    """A run config must be a frozen dataclass with an ``out`` field (TypeError otherwise)."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"a run config must be a dataclass instance, got {type(config).__name__}")
    params = getattr(type(config), "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"{type(config).__name__} must be a frozen dataclass")
    if not hasattr(config, "out"):
        raise TypeError(f"{type(config).__name__} has no 'out' field (the results folder)")


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


# -- running ------------------------------------------------------------------------------------
def run_sweep(
    recipe: Recipe, config: Any, out: str | Path, executor: Executor, *, command: str = ""
) -> dict[str, Any]:
    """Run (or resume) every cell into ``out``; return the selections by cell name, in cell
    order (``selected_hparams.json``, rewritten as cells finish). Then ``plan.json`` lists the
    runs of this ``command`` (records its cells looked up or wrote): reports summarise them
    only (:meth:`RunStore.load_planned`). A Slurm executor may raise ``SweepDetached``."""
    check_config(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "selected_hparams.json"
    names = [recipe.cell_name(c) for c in recipe.cells]
    selected: dict[str, Any] = {}
    runs: set[str] = set()

    def save() -> None:
        write_json(path, {n: selected[n] for n in names if n in selected})

    store = RunStore(out)

    def on_cell(name: str, selection: dict[str, Any], cell_runs: Iterable[str]) -> None:
        cell_runs = set(cell_runs)
        selected[name] = selection
        runs.update(cell_runs)
        save()
        store.sweep_cell_done(name, cell_runs)

    count = recipe.planned_runs
    planned = None if count is None else sum(int(count(config, c)) for c in recipe.cells)
    # until end_sweep, reports say "partial"
    store.begin_sweep(command, names, planned, output_settings=_output_settings(config))
    executor.run(recipe, config, out, on_cell)
    save()
    store.write_plan(runs, command)
    store.end_sweep()
    return {n: selected[n] for n in names}


LOCK_FILE = ".dselectk.lock"


@contextlib.contextmanager
def folder_lock(out: Path) -> Iterator[None]:
    """Hold ``out``'s lock for one command: a second command into the same folder stops at
    once with a ValueError, instead of two writers sharing one ``plan.json``, report and
    summary. The lock is the kernel's (``flock``): released when the process ends, however."""
    fd = os.open(Path(out) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise ValueError(
                f"--out {out}: another dselectk command is running there (pid {other}); wait "
                "for it to finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


#: the files of a results folder that a report rewrites (kept in step by :func:`report_pair`)
REPORT_FILES = ("summary.json", "report.md")
#: run-config fields that change what a run writes beside its record (not its result, so not
#: its run id): a finished run is never rerun for them
OUTPUT_SETTINGS = ("telemetry", "record_every")
#: where a report of an earlier command with other runs is kept (``previous/<n>/``)
PREVIOUS_DIR = "previous"
_RECORD_NAME = re.compile(r"[0-9a-f]{16}\.json")


def check_results_folder(out: Path) -> None:
    """Refuse, before anything is written or trained, a results folder this package did not
    make (ValueError, one line): an existing folder with files but no ``runs/`` (``--out .``:
    its ``report.md``/``summary.json`` would be replaced), the ``runs/`` folder of a results
    folder (``--out A/runs``), or a ``runs/`` holding what is not a run record."""
    out = Path(out)
    parent = out.resolve().parent if out.exists() else out.absolute().parent
    if out.name == "runs" and any((parent / f).is_file() for f in (*REPORT_FILES, SWEEP_FILE)):
        raise ValueError(
            f"--out {out}: the runs/ folder of the results folder {parent}; pass --out {parent} "
            "to continue it, or another folder"
        )
    if not out.is_dir():
        return
    runs = out / "runs"
    mine = {LOCK_FILE}
    if not runs.is_dir():
        theirs = sorted(p.name for p in out.iterdir() if p.name not in mine)
        if theirs:
            shown = ", ".join(theirs[:4]) + (", ..." if len(theirs) > 4 else "")
            raise ValueError(
                f"--out {out}: the folder exists and is not a results folder (no runs/; it "
                f"holds {shown}), whose files a report would replace; choose a new or empty "
                "folder"
            )
        return
    for p in sorted(runs.iterdir()):
        if p.name.startswith(".") and p.name.endswith(".tmp"):  # an interrupted record write
            continue
        if p.is_dir() and _RECORD_NAME.fullmatch(p.name):
            # a folder where a run's record goes: nothing of a user's to overwrite; that run's
            # write fails and is reported as the run's error (IsADirectoryError)
            continue
        if not (p.is_file() and _RECORD_NAME.fullmatch(p.name)):
            raise ValueError(
                f"--out {out}: {p} is not a run record (runs/ holds only <run id>.json files "
                "this package writes); this folder is not a results folder: choose another --out"
            )
        read_record(p)  # a ValueError naming the file


def _check_output_settings(out: Path, config: Any, command: str) -> None:
    """Refuse settings that would be credited but not applied: ``--telemetry`` or
    ``--record-every`` set (to another value than the default) on a rerun, with another
    command, into a folder whose finished runs were made without them: those runs are reused
    as they are, not retrained."""
    names = [n for n in OUTPUT_SETTINGS if hasattr(config, n)]
    if not names or not load_records(out / "runs", strict=False):
        return
    state = read_object(out / SWEEP_FILE)
    if state.get("command") == command:  # a resume: its runs so far were made the same way
        return
    before = state.get("output_settings") or {}
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    changed = [
        n
        for n in names
        if getattr(config, n) != defaults[n] and getattr(config, n) != before.get(n, defaults[n])
    ]
    if changed:
        flags = ", ".join(f"--{n.replace('_', '-')} {getattr(config, n)}" for n in changed)
        made = ", ".join(f"{n}={before.get(n, defaults[n])}" for n in changed)
        raise ValueError(
            f"{flags}: applies only to runs this command trains, and --out {out} already holds "
            f"finished runs that a rerun reuses as they are (made with {made}); choose a fresh "
            "--out to have it applied"
        )


def _output_settings(config: Any) -> dict[str, Any]:
    return {n: getattr(config, n) for n in OUTPUT_SETTINGS if hasattr(config, n)}


@contextlib.contextmanager
def report_pair(out: Path) -> Iterator[None]:
    """Rewrite a folder's ``summary.json`` and ``report.md`` together: when the block fails
    (a full disk, an error in a report), both are put back as they were, so they never
    disagree. The old files are copied first (a copy that fails stops the block before it
    replaces anything)."""
    out = Path(out)
    kept: list[tuple[Path, Path | None]] = []
    for name in REPORT_FILES:
        path, backup = out / name, out / f".{name}.previous"
        backup.unlink(missing_ok=True)
        if path.is_file():
            shutil.copy2(path, backup)  # (a full disk stops here, before anything is replaced)
            kept.append((path, backup))
        else:
            kept.append((path, None))
    try:
        yield
    except BaseException:
        for path, backup in kept:
            if backup is None:
                path.unlink(missing_ok=True)
            else:
                os.replace(backup, path)
        raise
    for _, backup in kept:
        if backup is not None:
            backup.unlink(missing_ok=True)


def keep_previous_report(out: Path, earlier_plan: Mapping[str, Any]) -> Path | None:
    """Before a command with other runs than the folder's last one replaces its report, move
    that report (``summary.json``, ``report.md``, ``plan.json``) to ``previous/<n>/``: no
    earlier command's report is lost. Returns the folder it went to, or None."""
    out = Path(out)
    try:
        plan = json.loads((out / PLAN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(plan, dict) or plan.get("runs") == earlier_plan.get("runs"):
        return None
    if not earlier_plan or not any((out / f).is_file() for f in REPORT_FILES):
        return None
    n = 1
    while (dest := out / PREVIOUS_DIR / str(n)).exists():
        n += 1
    dest.mkdir(parents=True)
    for name in REPORT_FILES:
        if (out / name).is_file():
            shutil.copy2(out / name, dest / name)
    write_json(dest / PLAN_FILE, earlier_plan)
    return dest


def note_earlier_reports(out: Path) -> list[str]:
    """List, at the end of ``report.md`` and in ``summary.json`` (``"earlier_commands"``), the
    commands whose reports :func:`keep_previous_report` kept in ``previous/<n>/``; returns them."""
    out = Path(out)
    earlier = []
    folders = (out / PREVIOUS_DIR).glob("*/")
    for d in sorted(folders, key=lambda p: int(p.name) if p.name.isdigit() else 0):
        command = read_object(d / PLAN_FILE).get("command") or "(command not recorded)"
        earlier.append({"command": command, "report": f"{PREVIOUS_DIR}/{d.name}/report.md"})
    if not earlier:
        return []
    summary_path, report_path = out / "summary.json", out / "report.md"
    if summary := read_object(summary_path):
        summary["earlier_commands"] = earlier
        write_json(summary_path, summary)
    if report_path.is_file():
        lines = [
            "",
            "## Earlier commands in this folder",
            "",
            "Their reports (other runs) are kept as they were:",
            "",
            *(f"- `{e['command']}`: {e['report']}" for e in earlier),
            "",
        ]
        text = report_path.read_text(encoding="utf-8").rstrip("\n") + "\n"
        write_text(report_path, text + "\n".join(lines))
    return [e["command"] for e in earlier]


def _check_same_experiment(out: Path, experiment: str) -> None:
    """ValueError when ``out`` holds records of an experiment other than ``experiment``."""
    # an unreadable record is the sweep's business (it names it), not this check's
    records = load_records(out / "runs", strict=False) if experiment else []
    if names := {record_experiment(r["config"]) for r in records} - {None, experiment}:
        raise ValueError(
            f"--out {out}: the folder holds records of another experiment "
            f"({', '.join(sorted(map(str, names)))}), whose report this run would overwrite; "
            "choose another --out"
        )


def run_recipe(recipe: Recipe, config: Any, executor: Executor) -> int:
    """The ``run`` of a recipe: check the results folder up front, size the executor to the
    cells, run (or resume) the sweep, rebuild the report and print its table; the exit code."""
    check_config(config)
    if recipe.write_report is None or recipe.print_table is None:
        raise TypeError("run_recipe needs a recipe with write_report and print_table")
    check_results_folder(Path(config.out))  # before anything is created there
    out = check_out_dir(config.out)
    executor = executor.sized(len(recipe.cells))
    command = " ".join(["dselectk", *sys.argv[1:]])
    with folder_lock(out):
        check_results_folder(out)  # (again: under the lock)
        _check_same_experiment(out, recipe.experiment)
        _check_output_settings(out, config, command)
        (out / "runs").mkdir(exist_ok=True)  # the folder is a results folder from here on
        if recipe.prepare is not None and not recipe.prepare(out, executor):
            return 0
        earlier_plan = read_object(out / PLAN_FILE)
        t0 = time.perf_counter()
        # the numba kernel compiled (or loaded) once, not by every worker at once; float32 only:
        # the recipes train in float32 (float64 would add ~20 s to a first, uncached run)
        warm_kernels((np.float32,))
        run_sweep(recipe, config, out, executor, command=command)
        wall = time.perf_counter() - t0
        jobs = {"jobs": executor.jobs, "threads": executor.threads}
        if kept := keep_previous_report(out, earlier_plan):
            print(f"the report of the folder's earlier command (other runs) is kept in {kept}")
        with report_pair(out):
            recipe.write_report(
                out, wall_seconds=wall, command=command, **(jobs if recipe.report_jobs else {})
            )
            note_earlier_reports(out)
        summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    recipe.print_table(summary)
    print(f"\nwall time {wall:.0f}s; report: {out / 'report.md'}")
    if recipe.diverged is not None and (message := recipe.diverged(summary)):
        print(f"dselectk: {message}", file=sys.stderr)
        return 1
    return 0
