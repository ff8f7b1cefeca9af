"""The Slurm executor: one Slurm job per cell, through submitit.

The cells go out as one job array; each job runs its cell (writing its records into the
results folder, as in local mode) and returns the cell's selection and run ids
(``<out>/slurm/<job>_0_result.pkl``, logs beside it). ``<out>/slurm_jobs.json`` lists every
job: its id, its cell, the sweep's settings key (:func:`sweep_key`) and, once collected, its
result or error. The same command again submits only the cells that are neither complete (a
result whose records all exist) nor queued/running (``squeue``), so a killed job loses only its
unfinished runs. Ctrl-C or ``--slurm-no-wait`` detaches (the jobs keep running; the same command
re-attaches); ``dselectk report DIR`` reads records only, so it works while jobs run."""

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

from dselectk.io import write_json
from dselectk.progress import tqdm
from dselectk_research.args import int_at_least
from dselectk_research.executors import OnCell, run_cell
from dselectk_research.records import RunStore

JOBS_FILE = "slurm_jobs.json"
LOG_DIR = "slurm"
#: squeue states of a job that is still going to produce a result
_ACTIVE = set(
    "PENDING RUNNING CONFIGURING COMPLETING SUSPENDED REQUEUED REQUEUE_HOLD REQUEUE_FED "
    "RESIZING SIGNALING STAGE_OUT".split()
)
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


@dataclass(frozen=True)
class SlurmExecutor:
    """The :class:`~dselectk_research.executors.Executor` of ``--executor slurm`` (module
    docstring); ``threads`` is the jobs' CPUs."""

    options: SlurmOptions
    progress: bool = True
    jobs: int = 1

    @property
    def threads(self) -> int:
        return self.options.cpus

    def sized(self, cells: int) -> SlurmExecutor:
        return self

    def run(self, recipe: Any, config: Any, out: Path, on_cell: OnCell) -> None:
        run_slurm(recipe, config, out, self.options, progress=self.progress, on_cell=on_cell)


#: the integer ``--slurm-*`` flags: SlurmOptions field, flag, least value, help
_INT_FLAGS = [
    ("time_min", "time", 1, "time limit per job, in minutes"),
    ("cpus", "cpus", 1, "CPUs (threads) per job"),
    ("gpus", "gpus", 0, "GPUs per job"),
    ("array_parallelism", "array-parallelism", 1, "jobs of the array running at once"),
]
#: the metavars of the integer flags
_INT_METAVARS = {"time": "MIN", "cpus": "N", "gpus": "N", "array-parallelism": "N"}


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def add_executor_arguments(p: argparse.ArgumentParser) -> None:
    """The executor flags shared by every recipe (``--executor`` and ``--slurm-*``)."""
    p.add_argument(
        "--executor",
        choices=["local", "slurm"],
        default="local",
        help="local: this machine (--jobs workers); slurm: one Slurm job per cell "
        "(needs submitit); rerun the same command to resume or re-attach",
    )
    g = p.add_argument_group(
        "Slurm (with --executor slurm)",
        "where and how the cells' jobs run; refused without --executor slurm",
    )
    g.add_argument(
        "--slurm-partition",
        default=None,
        metavar="NAME",
        help="partition (default: the cluster's default)",
    )
    for name, flag, least, doc in _INT_FLAGS:
        default = getattr(SlurmOptions, name)
        g.add_argument(
            f"--slurm-{flag}",
            type=int_at_least(least),
            default=default,
            metavar=_INT_METAVARS[flag],
            help=doc,
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
    """The Slurm options of ``--executor slurm``; None for the local executor, where a
    ``--slurm-*`` flag would have no effect: then a ValueError naming it."""
    if getattr(args, "executor", "local") != "slurm":
        given = [
            f"--slurm-{flag}"
            for flag, default in _slurm_defaults().items()
            if getattr(args, "slurm_" + flag.replace("-", "_"), default) != default
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)}: Slurm flags apply only with --executor slurm (this command "
                "runs locally, where they would have no effect); drop them or add --executor slurm"
            )
        return None
    ints = {
        name: int(getattr(args, "slurm_" + flag.replace("-", "_"), getattr(SlurmOptions, name)))
        for name, flag, _, _ in _INT_FLAGS
    }
    return SlurmOptions(
        partition=getattr(args, "slurm_partition", None),
        extra=dict(getattr(args, "slurm_opt", None) or []),
        wait=not getattr(args, "slurm_no_wait", False),
        **ints,
    )


def _slurm_defaults() -> dict[str, Any]:
    """The ``--slurm-*`` flags (without the prefix) and their defaults."""
    ints = {flag: getattr(SlurmOptions, name) for name, flag, _, _ in _INT_FLAGS}
    return {"partition": None, **ints, "opt": [], "no-wait": False}


def sweep_key(config: Any) -> str:
    """A hash of the run config (what the cells compute, not where they run): jobs of another
    command in the same folder never count for this one."""
    text = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cell_job(recipe: Any, config: Any, cell: Any, threads: int) -> dict[str, Any]:
    """One cell in a Slurm job (the submitit result: its selection and run ids)."""
    t0 = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    name, selection, runs = run_cell(recipe, config, cell, recipe.load_data(config), False)
    seconds = time.perf_counter() - t0
    return {"cell": name, "selection": selection, "runs": sorted(runs), "seconds": seconds}


def squeue_states(job_ids: Iterable[str]) -> dict[str, str]:
    """The squeue state of each of ``job_ids`` still known to Slurm (array tasks one by one)."""
    wanted = set(job_ids)
    if not wanted:
        return {}
    out = subprocess.run(
        ["squeue", "-h", "-r", "-o", "%i %T"], capture_output=True, text=True, check=True
    ).stdout
    pairs = (line.split() for line in out.splitlines())
    return {p[0]: p[1] for p in pairs if len(p) == 2 and p[0] in wanted}


def _make_slurm_executor(folder: Path, opts: SlurmOptions) -> Any:
    try:
        import submitit
    except ImportError:
        raise ValueError("--executor slurm needs submitit: pip install submitit") from None
    if shutil.which("sbatch") is None:
        raise ValueError("--executor slurm: sbatch not found (is this a Slurm login node?)")
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    optional = {
        "gpus_per_node": opts.gpus,
        "slurm_partition": opts.partition,
        "slurm_additional_parameters": dict(opts.extra),
    }
    ex.update_parameters(
        timeout_min=opts.time_min,
        cpus_per_task=opts.cpus,
        tasks_per_node=1,
        nodes=1,
        slurm_array_parallelism=opts.array_parallelism,
        name="dselectk",
        **{k: v for k, v in optional.items() if v},
    )
    return ex


def _settle(entry: dict[str, Any], live: Mapping[str, str], folder: Path) -> bool:
    """Whether the job of ``entry`` is over: its submitit result read into the entry
    (``result`` or ``error``), or gone from the queue without one; False while it is queued or
    running (``live``: the squeue states)."""
    path = folder / f"{entry['job_id']}_0_result.pkl"
    if not path.is_file():
        if live.get(entry["job_id"], "") in _ACTIVE:
            return False
        entry["error"] = f"{_LOST} (state {live.get(entry['job_id'], 'gone')})"
        return True
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


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown error"


def run_slurm(
    recipe: Any,
    config: Any,
    out: Path,
    opts: SlurmOptions,
    *,
    progress: bool,
    on_cell: OnCell,
    make_executor: Callable[[Path, SlurmOptions], Any] | None = None,
    states: Callable[[Iterable[str]], Mapping[str, str]] | None = None,
    log: Callable[[str], None] = print,
) -> None:
    """Run (or resume / re-attach to) the sweep's cells as Slurm jobs; ``on_cell`` once per
    complete cell (earlier commands' included). Raises :class:`SweepDetached` or, after printing
    which cells failed and why, :class:`SweepFailed`. ``make_executor`` (submitit's) and
    ``states`` (:func:`squeue_states`) are for tests."""
    states = states or squeue_states
    out = Path(out)
    folder, book_path = out / LOG_DIR, out / JOBS_FILE
    book: list[dict[str, Any]] = []
    if book_path.is_file():
        try:
            book = list(json.loads(book_path.read_text(encoding="utf-8"))["jobs"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{book_path}: not a valid Slurm job list ({err})") from None
    key = sweep_key(config)
    store = RunStore(out)
    cells = {recipe.cell_name(c): c for c in recipe.cells}

    def save_book() -> None:
        write_json(book_path, {"jobs": book})

    latest = {e["cell"]: e for e in book if e.get("key") == key and e.get("cell") in cells}
    pending = {n: e for n, e in latest.items() if "result" not in e and "error" not in e}
    live = states(e["job_id"] for e in pending.values())
    # the jobs squeue calls queued or running wait (their results are read as they end, so a
    # job that ends now is reported, not resubmitted); the others' results or errors go into
    # the book
    waiting = {
        n: e
        for n in cells
        if (e := pending.get(n))
        and (live.get(e["job_id"], "") in _ACTIVE or not _settle(e, live, folder))
    }
    save_book()

    to_submit: list[str] = []
    done = 0
    for name in cells:
        res = latest[name].get("result") if name in latest else None
        if res is not None and all(store.runs.joinpath(f"{r}.json").is_file() for r in res["runs"]):
            on_cell(name, res["selection"], res["runs"])  # complete: every record is there
            done += 1
        elif name not in waiting:
            to_submit.append(name)
    if waiting:
        log(f"re-attached to {len(waiting)} queued/running Slurm job(s) of this sweep")
    if to_submit:
        executor = (make_executor or _make_slurm_executor)(folder, opts)
        n = len(to_submit)
        try:
            jobs = executor.map_array(
                cell_job, [recipe] * n, [config] * n, [cells[c] for c in to_submit], [opts.cpus] * n
            )
        except Exception as e:  # sbatch refused (no controller, bad partition, bad --slurm-*)
            if type(e).__name__ != "FailedJobError":
                raise
            why = _last_line(str(e))
            raise OSError(f"--executor slurm: the submission failed: {why}") from None
        now = time.time()
        for name, job in zip(to_submit, jobs):
            waiting[name] = {"job_id": str(job.job_id), "cell": name, "key": key, "submitted": now}
            book.append(waiting[name])
        save_book()
        log(f"submitted {n} Slurm job(s): {', '.join(str(j.job_id) for j in jobs)}")
    if not waiting:
        return

    def detached() -> str:
        ids = " ".join(e["job_id"] for e in waiting.values())
        return (
            f"detached: {len(waiting)} Slurm job(s) keep running ({ids}); run the same command "
            f"again to re-attach (it submits only missing cells); `dselectk report {out}` "
            f"works meanwhile; scancel {ids} to stop them"
        )

    if not opts.wait:
        log(detached())
        raise SweepDetached(0)

    # wait: poll the jobs until each has a result or is gone
    failed: dict[str, str] = {}
    bar = tqdm(total=len(cells), initial=done, disable=not progress, desc="cells (slurm)")
    try:
        while waiting:
            live = states(e["job_id"] for e in waiting.values())
            for name, entry in list(waiting.items()):
                if not _settle(entry, live, folder):
                    continue
                del waiting[name]
                if "result" in entry:
                    res = entry["result"]
                    on_cell(name, res["selection"], res["runs"])
                    bar.set_postfix_str(f"{name} {res.get('seconds', 0):.0f}s")
                else:
                    why, jid = _last_line(entry["error"]), entry["job_id"]
                    failed[name] = f"job {jid}: {why} (log: {folder / f'{jid}_0_log.err'})"
                    print(f"cell {name} failed: {failed[name]}", file=sys.stderr)
                bar.update(1)
                save_book()
            if waiting:
                n_rec = sum(1 for _ in store.runs.glob("*.json"))
                running = sum(1 for e in waiting.values() if live.get(e["job_id"]) == "RUNNING")
                bar.set_description_str(
                    f"cells (slurm: {running} running, {len(waiting) - running} queued, "
                    f"{n_rec} records)"
                )
                time.sleep(opts.poll_s)
    except KeyboardInterrupt:
        bar.close()
        print(f"\n{detached()}", file=sys.stderr)
        raise SweepDetached(130) from None
    bar.close()
    if failed:
        lines = "\n".join(f"  {name}: {why}" for name, why in failed.items())
        print(
            f"dselectk: error: {len(failed)} of {len(cells)} cells failed (the others' records "
            f"are in {out}; rerun to resubmit the failed cells):\n{lines}",
            file=sys.stderr,
        )
        raise SweepFailed(1)
