"""Result records: one JSON file per finished run, ``runs/<run_id>.json`` (:func:`run_id`: a
stable hash of its resolved config), written atomically once the run has finished, so a killed
sweep leaves a complete record or none and the same command restarted skips finished runs."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dselectk import io as _io
from dselectk._testing import pause_point


def record_experiment(config: Mapping[str, Any]) -> str | None:
    """The experiment a run record belongs to: the study it was run for
    (``config["data"]["study"]``: the selection study's C.1 runs are synthetic runs), else
    ``config["experiment"]``."""
    data = config.get("data")
    study = data.get("study") if isinstance(data, Mapping) else None
    return study or config.get("experiment")


def run_id(config: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit id of a resolved run config (key order does not matter)."""
    blob = json.dumps(_io.json_safe(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: the optional packages whose presence changes what a run computes or shows: numba (the
#: DSelect-k CPU kernel ``auto`` picks, whose rounding moves discrete searches) and tqdm
EXTRAS = ("numba", "tqdm")


def resolved_kernel() -> str:
    """The DSelect-k CPU kernel ``DSELECTK_KERNEL`` picks now: ``numba``, ``numpy`` or ``aten``
    (unset, empty or ``auto``: numba when installed, else numpy; another value is returned as
    written, lower-cased: the library refuses it when a gate runs)."""
    choice = (os.environ.get("DSELECTK_KERNEL") or "auto").strip().lower() or "auto"
    if choice == "auto":
        return "numba" if _installed("numba") is not None else "numpy"
    return choice


@functools.cache
def _installed(package: str) -> str | None:
    """The installed version of ``package`` (None: not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def produced_by(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Which kernels and extras produced ``records`` (from each record's environment): the
    kernels, sorted, and each extra's versions, sorted ("not installed" for None); records
    written before these were recorded count as "not recorded"."""
    kernels: set[str] = set()
    extras: dict[str, set[str]] = {name: set() for name in EXTRAS}
    for r in records:
        env = r.get("environment") or {}
        kernels.add(str(env.get("kernel") or "not recorded"))
        got = env.get("extras")
        for name in EXTRAS:
            if not isinstance(got, Mapping):
                extras[name].add("not recorded")
            else:
                extras[name].add(str(got.get(name) or "not installed"))
    return {"kernels": sorted(kernels), "extras": {k: sorted(v) for k, v in extras.items()}}


@functools.cache
def _static_environment() -> tuple[tuple[str, Any], ...]:
    """What a record says of its environment that cannot change within a process, computed
    once (the git commit costs a subprocess; a sweep saves thousands of records)."""
    from dselectk import __version__

    try:
        git = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        commit = git.stdout.strip() or None if git.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return (
        ("dselectk", __version__),
        ("git_commit", commit),
        ("torch", torch.__version__),
        ("python", platform.python_version()),
        ("machine", platform.machine()),
        ("processor", platform.processor() or platform.machine()),
    )


#: The layout of a run record, stamped in every record as ``"schema"``: 2 adds the stamp and
#: counts exploded runs as diverged (:func:`diverged`). Records without it were written by
#: earlier versions of this package; the results folders that hold them name the commit.
SCHEMA_VERSION = 2

#: which runs the last command of a results folder consists of
PLAN_FILE = "plan.json"
#: the state of the last sweep started in a results folder: its cells, the cells and runs
#: finished so far, and whether it finished (a report made before it did says it is partial)
SWEEP_FILE = "sweep.json"


class RunStore:
    """The ``runs/`` folder of the results directory ``root``: ``root/runs/<run_id>.json``.

    With ``track``, :attr:`tracked` collects the id of every run whose record this store looks
    up or writes (through :meth:`path`: ``done``, ``save``): the runs a cell consists of
    (:func:`dselectk_research.executors.run_cell` hands a cell such a store)."""

    def __init__(self, root: str | Path, *, track: bool = False) -> None:
        self.root = Path(root)
        self.runs = self.root / "runs"
        self.tracked: set[str] | None = set() if track else None
        self.remove_stale_temps()

    def remove_stale_temps(self) -> None:
        """Delete the temp files of record writes whose process is gone (a sweep killed
        mid-write cannot remove its own); only this host's: on a shared filesystem another
        node's pids mean nothing here."""
        for tmp in self.runs.glob(".*.tmp"):
            parts = tmp.name.split(".")  # io's temp names: .<name>.<host>-<pid>.<random>.tmp
            who, _, pid = (parts[-3] if len(parts) >= 5 else "").rpartition("-")
            if who != _io.HOST or not pid.isdigit():
                continue
            try:
                os.kill(int(pid), 0)  # is the writer alive? (PermissionError: yes, not ours)
            except ProcessLookupError:
                tmp.unlink(missing_ok=True)
            except PermissionError:
                pass

    def path(self, rid: str) -> Path:
        """The record file of run ``rid`` (a tracking store counts the run as planned)."""
        if self.tracked is not None:
            self.tracked.add(rid)
        return self.runs / f"{rid}.json"

    def done(self, config: Mapping[str, Any]) -> bool:
        """Whether a complete record of this config exists."""
        return self.path(run_id(config)).is_file()

    def save(self, config: Mapping[str, Any], metrics: Mapping[str, Any], **extra: Any) -> Path:
        """Write the record of a finished run (config, metrics, environment) atomically."""
        rid = run_id(config)
        env = dict(_static_environment())
        env["threads"] = torch.get_num_threads()  # (pool workers set it)
        env["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        env["kernel"] = resolved_kernel()  # (the variable is read at each gate call)
        env["extras"] = {name: _installed(name) for name in EXTRAS}
        record = {
            "schema": SCHEMA_VERSION,
            "run_id": rid,
            "config": dict(config),
            "metrics": dict(metrics),
        }
        path = _io.write_json(self.path(rid), {**record, "environment": env, **extra})
        pause_point("record-saved")  # test-only; see dselectk._testing
        return path

    def load_planned(self) -> tuple[list[dict[str, Any]], int]:
        """The records of the last command that ran in this folder (its ``plan.json``; all
        records without one), and how many other records the folder holds: summaries never
        average runs made with different settings. While a sweep has not finished
        (:meth:`sweep_status`), its runs so far."""
        records, plan = self.load(), self.root / PLAN_FILE
        if (status := self.sweep_status()) is not None:
            planned = status["_ids"]
        elif not plan.is_file():
            return records, 0
        else:
            try:
                planned = {str(x) for x in json.loads(plan.read_text(encoding="utf-8"))["runs"]}
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise ValueError(f"{plan}: not a valid plan file ({e})") from None
        mine = [r for r in records if r.get("run_id") in planned]
        return mine, len(records) - len(mine)

    # -- the state of a sweep ----------------------------------------------------------------
    def begin_sweep(
        self,
        command: str,
        cells: Sequence[str],
        planned_runs: int | None,
        output_settings: Mapping[str, Any] | None = None,
    ) -> None:
        """Record that a sweep of ``cells`` starts (``planned_runs``: its final runs, when the
        recipe can count them up front; ``output_settings``: what its runs write beside their
        records, e.g. telemetry)."""
        state = {
            "output_settings": dict(output_settings or {}),
            "command": command,
            "cells": list(cells),
            "planned_runs": planned_runs,
            "started": time.time(),
            "finished": False,
            "cells_done": [],
            "runs_done": [],
        }
        _io.write_json(self.root / SWEEP_FILE, state)

    def sweep_cell_done(self, cell: str, runs: Iterable[str]) -> None:
        """Record that a cell of the running sweep finished, with its runs."""
        if (state := self._sweep_state()) is not None:
            if cell not in state["cells_done"]:
                state["cells_done"].append(cell)
            state["runs_done"] = sorted(set(state["runs_done"]) | set(runs))
            _io.write_json(self.root / SWEEP_FILE, state)

    def end_sweep(self) -> None:
        """Record that the running sweep finished (its ``plan.json`` is written)."""
        if (state := self._sweep_state()) is not None:
            state.update(finished=True, ended=time.time())
            _io.write_json(self.root / SWEEP_FILE, state)

    def _sweep_state(self) -> dict[str, Any] | None:
        path = self.root / SWEEP_FILE
        if not path.is_file():
            return None
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(state, dict):
                raise TypeError("not an object")
            state["cells"] = [str(c) for c in state["cells"]]
            state["cells_done"] = [str(c) for c in state.get("cells_done", [])]
            state["runs_done"] = [str(r) for r in state.get("runs_done", [])]
            state["started"] = float(state["started"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a valid sweep state ({e})") from None
        return state

    def sweep_status(self) -> dict[str, Any] | None:
        """None when the last sweep of this folder finished (or none was recorded); else how
        far it got, with ``_ids``: its run ids so far (the finished cells' runs and every record
        written since it started), of which ``recorded`` final runs."""
        state = self._sweep_state()
        if state is None or state.get("finished"):
            return None
        ids = set(state["runs_done"])
        for p in self.runs.glob("*.json"):
            with contextlib.suppress(OSError):  # (deleted meanwhile)
                if p.stat().st_mtime >= state["started"]:
                    ids.add(p.stem)
        recorded = 0
        for rid in ids:
            try:
                rec = read_record(self.runs / f"{rid}.json")
            except ValueError:  # not written yet, or unreadable: the sweep names it
                continue
            recorded += rec["config"].get("phase", "final") == "final"
        return {
            "command": state.get("command"),
            "cells": len(state["cells"]),
            "cells_done": len(set(state["cells_done"]) & set(state["cells"])),
            "cells_missing": [c for c in state["cells"] if c not in state["cells_done"]],
            "planned_runs": state.get("planned_runs"),
            "recorded": recorded,
            "_ids": ids,
        }

    def write_plan(self, run_ids: Iterable[str], command: str) -> Path:
        """Record which runs the current command consists of (see :meth:`load_planned`)."""
        return _io.write_json(
            self.root / PLAN_FILE, {"command": command, "runs": sorted(set(run_ids))}
        )

    def load(self, *, strict: bool = True) -> list[dict[str, Any]]:
        """All complete records, sorted by run id; an unreadable file raises a ValueError
        naming it, or with ``strict=False`` is passed over (by checks that may ignore it)."""
        return load_records(self.runs, strict=strict)


def read_record(path: Path) -> dict[str, Any]:
    """One run record, or a ValueError naming ``path`` and what is wrong with it."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a valid run record ({e})") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: a folder where a run record belongs") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the run record ({e.strerror})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{path}: not a valid run record (a JSON {type(rec).__name__})")
    for key in ("config", "metrics"):
        if not isinstance(rec.get(key), dict):
            raise ValueError(
                f"{path}: not a valid run record ({key!r} missing or not an object); "
                "move it away or delete it, then rerun"
            )
    return rec


def load_records(runs: Path, *, strict: bool = True) -> list[dict[str, Any]]:
    """The records of a ``runs/`` folder, sorted by run id (see :meth:`RunStore.load`); reads
    and deletes nothing else (unlike :class:`RunStore`, which clears stale temp files)."""
    records: list[dict[str, Any]] = []
    for p in sorted(runs.glob("*.json")):
        try:
            records.append(read_record(p))
        except ValueError:
            if strict:
                raise
    return records


def mean_se(values: Sequence[float]) -> dict[str, float | int]:
    """Mean, standard error (sample std / sqrt(n)) and count of the finite values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    mean = sum(xs) / n if n else math.nan
    se = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1) / n) if n > 1 else math.nan
    return {"mean": mean, "se": se, "n": n}


#: How far above the loss of a trivial predictor (predicting 0, or the uniform distribution) a
#: run's loss may finish before it counts as exploded: each study's :data:`FINITE`-style bounds
#: (``{metric: bound}``) are this factor times its trivial loss, stated beside them. A run
#: beyond its bound learned nothing a mean or a paired comparison could use (``--lr 1e6``
#: finishes at a test MSE of 1e13 without a single NaN).
EXPLOSION_FACTOR = 100.0

#: Metrics a run must have: a sequence of names (finite values) or ``{name: bound}`` (finite
#: and at most ``bound``; ``math.inf``: finite only).
Bounds = Sequence[str] | Mapping[str, float]


def diverged(record: Mapping[str, Any], metrics: Bounds) -> bool:
    """Whether a run diverged: its record says so (``"diverged": true``), one of the
    ``metrics`` is missing or not finite (NaN is saved as JSON null), or it exploded: it lies
    above its bound (``metrics`` as ``{name: bound}``, see :data:`EXPLOSION_FACTOR`)."""
    if record.get("diverged"):
        return True
    values = record.get("metrics", {})
    limits = metrics if isinstance(metrics, Mapping) else dict.fromkeys(metrics, math.inf)
    for name, bound in limits.items():
        v = values.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return True
        if v > bound:
            return True
    return False


def summarize(
    records: Iterable[Mapping[str, Any]],
    group_by: Sequence[str],
    *,
    finite: Bounds | None = None,
) -> list[dict[str, Any]]:
    """One row per distinct value of the config keys ``group_by``, with mean/se/n of each
    numeric metric (over its finite values). With ``finite`` (the metrics a run must have finite,
    or ``{name: bound}``: finite and at most the bound), each row also counts its ``runs`` and
    how many ``diverged`` (:func:`diverged`), so a run lost to NaN or an explosion stays
    visible; the means are then over the runs that did not diverge."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in records:
        key = tuple(json.dumps(r["config"].get(k)) for k in group_by)
        groups.setdefault(key, []).append(r)
    rows = []
    for key, recs in sorted(groups.items()):
        row: dict[str, Any] = {k: json.loads(v) for k, v in zip(group_by, key)}
        names = sorted(
            {m for r in recs for m, v in r["metrics"].items() if isinstance(v, (int, float))}
            | set(finite or ())  # present with n = 0 when every run of the row diverged
        )
        ok = recs if finite is None else [r for r in recs if not diverged(r, finite)]
        row["metrics"] = {m: mean_se([r["metrics"].get(m, math.nan) for r in ok]) for m in names}
        if finite is not None:
            row["runs"] = len(recs)
            row["diverged"] = len(recs) - len(ok)
        rows.append(row)
    return rows


def wall_time(
    results_dir: str | Path,
    previous: Mapping[str, Any],
    wall_seconds: float | None,
    command: str | None,
    records: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The wall time of the commands that produced a folder's summarised runs, for its summary:
    a command that continues the previous one (the same plan: a resume, a Slurm re-attach, a
    rerun) adds its time to the previous summary's, so a resume never overwrites 421 s by the
    2 s it took to find everything done. A command with another plan starts a new total; the
    planned ``records`` written before it started (by earlier commands, whose time is not known
    here) count as ``runs_untimed``. ``wall_seconds`` None (``dselectk report``) keeps the
    previous summary's value."""
    results_dir = Path(results_dir)
    prev = previous.get("wall_time")
    if not isinstance(prev, Mapping):  # no previous summary (or not one of this package's)
        prev = {"seconds": None, "commands": [], "plan": None, "runs_untimed": 0}
    if wall_seconds is None:
        return dict(prev)
    try:  # the digest of plan.json's run ids (which runs the last command consists of)
        runs = json.loads((results_dir / PLAN_FILE).read_text(encoding="utf-8"))["runs"]
        plan = hashlib.sha256(json.dumps(sorted(runs)).encode()).hexdigest()[:16]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        plan = None
    same = plan is not None and prev.get("plan") == plan
    this = {"command": command, "seconds": float(wall_seconds)}
    if same and prev.get("commands"):
        commands = [*prev["commands"], this]
        untimed = int(prev.get("runs_untimed") or 0)
    else:
        commands = [this]
        start = time.time() - float(wall_seconds) - 1.0
        untimed = 0
        for r in records:
            with contextlib.suppress(OSError):
                if (results_dir / "runs" / f"{r.get('run_id')}.json").stat().st_mtime < start:
                    untimed += 1
    total = sum(float(c["seconds"]) for c in commands if isinstance(c.get("seconds"), (int, float)))
    return {"seconds": total, "commands": commands, "plan": plan, "runs_untimed": untimed}


def sweep_summary(
    results_dir: str | Path,
    experiment: str,
    group_by: Sequence[str],
    records: Sequence[Mapping[str, Any]],
    others: int,
    finite: Bounds,
    wall_seconds: float | None,
    command: str | None,
    **given: Any,
) -> dict[str, Any]:
    """What every sweep's ``summary.json`` holds: its ``records`` (the final runs of the last
    command, ``others`` of the folder's records left out) summarised into rows by ``group_by``
    (:func:`summarize`), how many diverged, the wall time (:func:`wall_time`), and the values
    of this ``command`` (and the others ``given``), each None one kept from the last summary."""
    prev = read_object(Path(results_dir) / "summary.json")
    rows = summarize(records, group_by, finite=finite)
    wall = wall_time(results_dir, prev, wall_seconds, command, records)
    given = {"command": command, **given}
    return {
        "experiment": experiment,
        "group_by": list(group_by),
        "rows": rows,
        "records": len(records),
        "diverged": sum(int(r.get("diverged", 0)) for r in rows),
        "records_not_summarised": others,
        "wall_seconds": wall["seconds"],
        "wall_time": wall,
        "produced_by": produced_by(records),
        **{k: v if v is not None else prev.get(k) for k, v in given.items()},
    }


def read_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when it is missing, unreadable or not an object. For the
    files a report only adds from (the previous ``summary.json``, ``selected_hparams.json``):
    the report is rebuilt from the records, a garbled extra never stops it."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def partial_line(status: Mapping[str, Any]) -> str:
    """One line saying a report is partial (see :meth:`RunStore.sweep_status`)."""
    planned = status.get("planned_runs")
    runs = (
        f"{status['recorded']} of {planned} planned final runs recorded"
        if planned
        else f"{status['recorded']} final runs recorded so far"
    )
    missing = status.get("cells_missing") or []
    more = f", missing {', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''}"
    return (
        f"PARTIAL: the sweep `{status.get('command')}` has not finished (Slurm jobs still "
        f"running, or the command was interrupted): {runs}, "
        f"{status['cells_done']} of {status['cells']} cells finished{more if missing else ''}; "
        "run the same command again to finish it"
    )
