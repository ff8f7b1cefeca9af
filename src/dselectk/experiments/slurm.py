"""The Slurm executor's driver: one Slurm job per cell, through submitit.

Slurm mode, in the runner's terms (a cell = its tuning + final runs, one record per run):

* **submit** — the cells go out as one submitit job array (``map_array``;
  ``--slurm-array-parallelism`` caps how many run at once); each job loads the data, runs its
  cell (records are written by the job into the results folder, atomically, as in local mode)
  and returns the cell's selection and run ids (the submitit result,
  ``<out>/slurm/<job>_0_result.pkl``; logs beside it);
* **bookkeeping** — ``<out>/slurm_jobs.json`` lists every submitted job: its id, its cell, the
  sweep's settings key (:func:`sweep_key`) and, once collected, its result or error;
* **resume** — the same command again submits only the cells that are neither complete (a
  successful result whose records all exist) nor queued/running (``squeue``); a job killed or
  preempted mid-way loses only its unfinished runs (the resubmitted cell skips existing records);
* **wait / detach** — the driver polls the jobs with a progress bar over cells (and records in
  the folder); Ctrl-C (or ``--slurm-no-wait``) detaches: the jobs keep running, and running the
  same command again re-attaches. ``dselectk report DIR`` reads records only, so it works while
  jobs run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pickle
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dselectk.experiments.args import int_at_least
from dselectk.experiments.records import RunStore, tracking
from dselectk.io import write_json
from dselectk.progress import tqdm

__all__ = [
    "JOBS_FILE",
    "SlurmOptions",
    "SweepDetached",
    "SweepFailed",
    "add_executor_arguments",
    "cell_job",
    "run_slurm",
    "slurm_options",
    "squeue_states",
    "sweep_key",
]

OnCell = Callable[[str, dict[str, Any], Iterable[str]], None]
#: state of a pool worker process (its data, progress-bar line); empty in the main process
_WORKER: dict[str, Any] = {}
JOBS_FILE = "slurm_jobs.json"
LOG_DIR = "slurm"
#: squeue states of a job that is still going to produce a result
_ACTIVE = {
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
}


_LOST = "job ended without a result (cancelled, killed, preempted or out of time)"


class SweepDetached(SystemExit):
    """The driver stopped waiting (Ctrl-C or ``--slurm-no-wait``); the jobs keep running."""


class SweepFailed(SystemExit):
    """Some cells' jobs failed (the message, printed, names them and why); exit status 1."""


@dataclass(frozen=True)
class SlurmOptions:
    """The ``--slurm-*`` flags."""

    partition: str | None = None
    time_min: int = 60
    cpus: int = 1
    gpus: int = 0
    array_parallelism: int = 256
    extra: dict[str, str] = field(default_factory=dict)
    wait: bool = True
    poll_s: float = 2.0


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def add_executor_arguments(p: argparse.ArgumentParser) -> None:
    """The executor flags shared by every recipe (``--executor`` and ``--slurm-*``)."""
    g = p.add_argument_group("executor")
    g.add_argument(
        "--executor",
        choices=["local", "slurm"],
        default="local",
        help="local: this machine (--jobs workers); slurm: one Slurm job per cell "
        "(needs dselectk[cluster]); rerun the same command to resume or re-attach",
    )
    g.add_argument("--slurm-partition", default=None, help="Slurm partition (default: the default)")
    g.add_argument(
        "--slurm-time", type=int_at_least(1), default=60, help="time limit per job, in minutes"
    )
    g.add_argument("--slurm-cpus", type=int_at_least(1), default=1, help="CPUs (threads) per job")
    g.add_argument("--slurm-gpus", type=int_at_least(0), default=0, help="GPUs per job")
    g.add_argument(
        "--slurm-array-parallelism",
        type=int_at_least(1),
        default=256,
        help="jobs of the array running at once",
    )
    g.add_argument(
        "--slurm-opt",
        type=_key_value,
        action="append",
        default=[],
        metavar="K=V",
        help="extra sbatch option (repeatable), e.g. --slurm-opt account=abc --slurm-opt qos=low",
    )
    g.add_argument(
        "--slurm-no-wait",
        action="store_true",
        help="submit and return (the same command again re-attaches)",
    )


def slurm_options(args: argparse.Namespace) -> SlurmOptions | None:
    """The Slurm options of ``--executor slurm``; None for the local executor."""
    if getattr(args, "executor", "local") != "slurm":
        return None
    return SlurmOptions(
        partition=getattr(args, "slurm_partition", None),
        time_min=int(getattr(args, "slurm_time", 60)),
        cpus=int(getattr(args, "slurm_cpus", 1)),
        gpus=int(getattr(args, "slurm_gpus", 0)),
        array_parallelism=int(getattr(args, "slurm_array_parallelism", 256)),
        extra=dict(getattr(args, "slurm_opt", None) or []),
        wait=not getattr(args, "slurm_no_wait", False),
    )


def sweep_key(config: Any) -> str:
    """A hash of the run config (what the cells compute, not where they run): jobs of another
    command in the same folder never count for this one."""
    items = dataclasses.asdict(config)
    text = json.dumps(items, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- the Slurm job ------------------------------------------------------------------------------
def cell_job(recipe: Any, config: Any, cell: Any, threads: int) -> dict[str, Any]:
    """One cell in a Slurm job: load the data, run the cell (records land in the results
    folder), return its selection and run ids (the submitit result)."""
    t0 = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    data = recipe.load_data(config)
    with tracking() as runs:
        selection = recipe.run_cell(config, cell, data, False)
    return {
        "cell": recipe.cell_name(cell),
        "selection": selection,
        "runs": sorted(runs),
        "seconds": time.perf_counter() - t0,
    }


# -- job states ---------------------------------------------------------------------------------
def squeue_states(job_ids: Iterable[str]) -> dict[str, str]:
    """The squeue state of each of ``job_ids`` still known to Slurm (array tasks one by one)."""
    wanted = set(job_ids)
    if not wanted:
        return {}
    out = subprocess.run(
        ["squeue", "-h", "-r", "-o", "%i %T"], capture_output=True, text=True, check=True
    ).stdout
    states: dict[str, str] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in wanted:
            states[parts[0]] = parts[1]
    return states


def _make_slurm_executor(folder: Path, opts: SlurmOptions) -> Any:
    try:
        import submitit
    except ImportError:
        raise ValueError(
            "--executor slurm needs submitit: pip install 'dselectk[cluster]'"
        ) from None
    if shutil.which("sbatch") is None:
        raise ValueError("--executor slurm: sbatch not found (is this a Slurm login node?)")
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    params: dict[str, Any] = {
        "timeout_min": opts.time_min,
        "cpus_per_task": opts.cpus,
        "tasks_per_node": 1,
        "nodes": 1,
        "slurm_array_parallelism": opts.array_parallelism,
        "name": "dselectk",
    }
    if opts.gpus:
        params["gpus_per_node"] = opts.gpus
    if opts.partition:
        params["slurm_partition"] = opts.partition
    if opts.extra:
        params["slurm_additional_parameters"] = dict(opts.extra)
    ex.update_parameters(**params)
    return ex


# -- bookkeeping --------------------------------------------------------------------------------
def _result_path(folder: Path, job_id: str) -> Path:
    return folder / f"{job_id}_0_result.pkl"


def _log_path(folder: Path, job_id: str) -> Path:
    return folder / f"{job_id}_0_log.err"


def _load_book(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    try:
        return list(json.loads(path.read_text(encoding="utf-8"))["jobs"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a valid Slurm job list ({e})") from None


def _collect(entry: dict[str, Any], folder: Path) -> bool:
    """Read a finished job's submitit result into its entry; False while there is none."""
    path = _result_path(folder, entry["job_id"])
    if not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            status, value = pickle.load(f)
    except Exception as e:  # a torn or foreign pickle: report it, do not crash
        status, value = "error", f"unreadable result {path}: {e}"
    if status == "success":
        entry["result"] = value
    else:
        entry["error"] = str(value)
    return True


def _complete(entry: dict[str, Any] | None, store: RunStore) -> bool:
    """A successful job whose records are all still there."""
    if entry is None or "result" not in entry:
        return False
    return all(store.runs.joinpath(f"{rid}.json").is_file() for rid in entry["result"]["runs"])


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown error"


# -- the driver ---------------------------------------------------------------------------------
def run_slurm(
    recipe: Any,
    config: Any,
    out: Path,
    opts: SlurmOptions,
    *,
    progress: bool,
    on_cell: Callable[[str, dict[str, Any], list[str]], None],
    make_executor: Callable[[Path, SlurmOptions], Any] | None = None,
    states: Callable[[Iterable[str]], Mapping[str, str]] | None = None,
    log: Callable[[str], None] = print,
) -> None:
    """Run (or resume / re-attach to) the sweep's cells as Slurm jobs.

    ``on_cell(name, selection, run_ids)`` is called once per complete cell (earlier invocations'
    included). Raises :class:`SweepDetached` when the driver stops waiting, :class:`SweepFailed`
    (after printing which cells failed and why) when jobs failed; the others' records land.
    ``make_executor`` (a submitit executor) and ``states`` (job id → squeue state of the jobs
    still queued/running) default to Slurm's; tests pass their own.
    """
    make_executor = make_executor or _make_slurm_executor
    states = states or squeue_states
    out = Path(out)
    folder = out / LOG_DIR
    book_path = out / JOBS_FILE
    book = _load_book(book_path)
    key = sweep_key(config)
    store = RunStore(out)
    cells = {recipe.cell_name(c): c for c in recipe.cells}

    def save_book() -> None:
        write_json(book_path, {"jobs": book})

    latest: dict[str, dict[str, Any]] = {}
    for entry in book:
        if entry.get("key") == key and entry.get("cell") in cells:
            latest[entry["cell"]] = entry
    pending = [e for e in latest.values() if "result" not in e and "error" not in e]
    live = states(e["job_id"] for e in pending) if pending else {}
    for e in pending:
        if live.get(e["job_id"], "") not in _ACTIVE and not _collect(e, folder):
            e["error"] = _LOST
    save_book()

    waiting: dict[str, dict[str, Any]] = {}
    to_submit: list[str] = []
    done = 0
    for name in cells:
        prev = latest.get(name)
        if prev is not None and _complete(prev, store):
            on_cell(name, prev["result"]["selection"], prev["result"]["runs"])
            done += 1
        elif prev is not None and live.get(prev["job_id"], "") in _ACTIVE:
            waiting[name] = prev
        else:
            to_submit.append(name)
    if waiting:
        log(f"re-attached to {len(waiting)} queued/running Slurm job(s) of this sweep")
    if to_submit:
        executor = make_executor(folder, opts)
        threads = opts.cpus
        try:
            jobs = executor.map_array(
                cell_job,
                [recipe] * len(to_submit),
                [config] * len(to_submit),
                [cells[n] for n in to_submit],
                [threads] * len(to_submit),
            )
        except Exception as e:  # sbatch refused (no controller, bad partition, bad --slurm-*)
            if type(e).__name__ != "FailedJobError":
                raise
            why = _last_line(str(e))
            raise OSError(f"--executor slurm: the submission failed: {why}") from None
        now = time.time()
        for name, job in zip(to_submit, jobs):
            entry = {"job_id": str(job.job_id), "cell": name, "key": key, "submitted": now}
            book.append(entry)
            waiting[name] = entry
        save_book()
        log(f"submitted {len(to_submit)} Slurm job(s): {', '.join(str(j.job_id) for j in jobs)}")
    if not waiting:
        return
    ids = " ".join(e["job_id"] for e in waiting.values())
    detach_msg = (
        f"detached: {len(waiting)} Slurm job(s) keep running ({ids}); run the same command "
        f"again to re-attach (it submits only missing cells); `dselectk report {out}` "
        f"works meanwhile; scancel {ids} to stop them"
    )
    if not opts.wait:
        log(detach_msg)
        raise SweepDetached(0)
    failed = _wait(
        waiting, folder, store, opts, progress, done, len(cells), states, on_cell, save_book
    )
    if failed:
        lines = "\n".join(f"  {name}: {why}" for name, why in failed.items())
        msg = (
            f"{len(failed)} of {len(cells)} cells failed (the others' records are in {out}; "
            f"rerun to resubmit the failed cells):\n{lines}"
        )
        print(f"dselectk: error: {msg}", file=sys.stderr)
        raise SweepFailed(1)


def _wait(
    waiting: dict[str, dict[str, Any]],
    folder: Path,
    store: RunStore,
    opts: SlurmOptions,
    progress: bool,
    done: int,
    total: int,
    states: Callable[[Iterable[str]], Mapping[str, str]],
    on_cell: Callable[[str, dict[str, Any], list[str]], None],
    save_book: Callable[[], None],
) -> dict[str, str]:
    """Poll the jobs until each has a result or is gone; returns the failures by cell."""
    failed: dict[str, str] = {}
    bar = tqdm(total=total, initial=done, disable=not progress, desc="cells (slurm)")
    try:
        while waiting:
            live = states(e["job_id"] for e in waiting.values())
            for name, entry in list(waiting.items()):
                jid = entry["job_id"]
                if not _collect(entry, folder):
                    if jid in live and live[jid] in _ACTIVE:
                        continue
                    if _collect(entry, folder):  # finished between squeue and the first look
                        pass
                    else:
                        entry["error"] = f"{_LOST} (state {live.get(jid, 'gone')})"
                del waiting[name]
                if "result" in entry:
                    res = entry["result"]
                    on_cell(name, res["selection"], res["runs"])
                    bar.set_postfix_str(f"{name} {res.get('seconds', 0):.0f}s")
                else:
                    why = _last_line(entry["error"])
                    failed[name] = f"job {jid}: {why} (log: {_log_path(folder, jid)})"
                    print(f"cell {name} failed: {failed[name]}", file=sys.stderr)
                bar.update(1)
                save_book()
            if waiting:
                n_rec = sum(1 for _ in store.runs.glob("*.json")) if store.runs.is_dir() else 0
                running = sum(1 for e in waiting.values() if live.get(e["job_id"]) == "RUNNING")
                bar.set_description_str(
                    f"cells (slurm: {running} running, {len(waiting) - running} queued, "
                    f"{n_rec} records)"
                )
                time.sleep(opts.poll_s)
    except KeyboardInterrupt:
        bar.close()
        ids = " ".join(e["job_id"] for e in waiting.values())
        print(
            f"\ndetached: {len(waiting)} Slurm job(s) keep running ({ids}); run the same command "
            "again to re-attach (it submits only missing cells); scancel them to stop",
            file=sys.stderr,
        )
        raise SweepDetached(130) from None
    bar.close()
    return failed
