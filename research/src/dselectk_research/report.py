"""``dselectk report DIR``: rebuild a results folder's summary, report and plots from its records.

The experiment module of the records' ``config["experiment"]`` (:data:`EXPERIMENTS`) exposes
``write_report(results_dir)``, which rebuilds ``summary.json``, ``report.md`` and the plots from
``results_dir/runs/*.json`` only (no training state, no data)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dselectk.io import write_json, write_text
from dselectk_research.records import RunStore, partial_line, read_object, record_experiment
from dselectk_research.runner import note_earlier_reports, report_pair

#: experiment name (``dselectk reproduce NAME``, ``config["experiment"]``) → its module
EXPERIMENTS: dict[str, str] = {
    "synthetic": "dselectk_research.synthetic",
    "recovery": "dselectk_research.recovery",
    "selection": "dselectk_research.selection",
    "movielens": "dselectk_research.movielens",
    "multi-mnist": "dselectk_research.multi_mnist",
    "multi-fashion": "dselectk_research.multi_mnist",
    "token-moe": "dselectk_research.token_moe",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``dselectk report``."""
    p.add_argument("dir", type=Path, help="results folder (holding runs/ and summary.json)")


def experiment_name(results_dir: Path) -> str:
    """The experiment of the run records (:func:`record_experiment`; else ``summary.json``'s);
    a ValueError when there is none, or records of several experiments in one folder."""
    names = {name for r in RunStore(results_dir).load() if (name := record_experiment(r["config"]))}
    if not names:
        if name := read_object(Path(results_dir) / "summary.json").get("experiment"):
            return str(name)
        raise ValueError(f"{results_dir}: no run records (runs/*.json) naming an experiment")
    if len(names) > 1:
        raise ValueError(f"{results_dir}: records of several experiments: {sorted(names)}")
    return str(names.pop())


def experiment_module(name: str) -> str:
    """Module implementing experiment ``name`` (:data:`EXPERIMENTS`, else experiments.<name>)."""
    return EXPERIMENTS.get(name, f"dselectk_research.{name.replace('-', '_')}")


def rebuild(results_dir: Path) -> str:
    """Call the experiment's ``write_report(results_dir)``; returns the experiment name."""
    results_dir = Path(results_dir)
    if not RunStore(results_dir).load():
        raise ValueError(
            f"{results_dir}: no run records in {results_dir / 'runs'}; the report is rebuilt "
            "from them, so the existing summary.json and report.md are left as they are"
        )
    name = experiment_name(results_dir)
    if name not in EXPERIMENTS:
        raise ValueError(
            f"{results_dir}: records of an unknown experiment {name!r}; expected one of "
            f"{', '.join(EXPERIMENTS)}"
        )
    with report_pair(results_dir):  # summary and report stay in step, whatever fails
        importlib.import_module(experiment_module(name)).write_report(results_dir)
        note_earlier_reports(results_dir)
        mark_partial(results_dir)
    return name


def mark_partial(results_dir: Path) -> str | None:
    """When the folder's last sweep has not finished (Slurm jobs still running, an interrupted
    command, cells missing), say so at the top of ``report.md`` and in ``summary.json``
    (``"partial"``: how many of the planned runs are recorded); returns that line, or None."""
    results_dir = Path(results_dir)
    status = RunStore(results_dir).sweep_status()
    if status is None:
        return None
    line = partial_line(status)
    summary_path, report_path = results_dir / "summary.json", results_dir / "report.md"
    if summary := read_object(summary_path):  # (a garbled summary.json is left as it is)
        summary["partial"] = {k: v for k, v in status.items() if not k.startswith("_")}
        summary["partial"]["line"] = line
        write_json(summary_path, summary)
    if report_path.is_file():
        text = report_path.read_text(encoding="utf-8")
        head, sep, rest = text.partition("\n")
        if head.startswith("# "):
            text = f"{head}\n\n> **{line}.**\n{sep}{rest}"
        else:
            text = f"> **{line}.**\n\n{text}"
        write_text(report_path, text)
    return line


def run(args: argparse.Namespace) -> int:
    """Entry point of ``dselectk report DIR``."""
    directory = Path(args.dir)
    if not directory.is_dir():
        what = "is a file" if directory.exists() else "no such folder"
        raise ValueError(f"{directory}: {what}, expected a results folder")
    name = rebuild(directory)  # a ValueError is a user error: the CLI prints it, exit code 2
    print(f"rebuilt the {name} report: {directory / 'report.md'}")
    if (status := RunStore(directory).sweep_status()) is not None:
        print(f"dselectk: {partial_line(status)}", file=sys.stderr)
    if line := diverged_line(read_object(directory / "summary.json")):
        print(f"dselectk: {line}", file=sys.stderr)
        return 1
    return 0


def diverged_line(summary: Mapping[str, Any]) -> str | None:
    """One line when the summarised final runs include diverged ones (non-finite or exploded
    losses, :func:`~dselectk_research.records.diverged`): the exit status of ``dselectk report``
    is then 1, as the sweep's was; else None (tuning runs that diverged are part of a grid)."""
    if not (runs := int(summary.get("diverged") or 0)):
        return None
    return (
        f"{runs} run(s) of this folder diverged (non-finite or exploded loss); report.md names "
        "them, counts them and leaves them out of its means"
    )
