"""``dselectk report DIR``: rebuild a results folder's summary, report and plots from its records.

Convention (shared by every experiment module under :mod:`dselectk.experiments`): a module that
writes run records with ``config["experiment"] = NAME`` exposes
``write_report(results_dir: Path) -> None``, which rebuilds ``summary.json``, ``report.md`` and
the PNG plots from ``results_dir/runs/*.json`` only (no training state, no data). This command
finds NAME in the records (or in ``summary.json``) and calls that module's ``write_report``.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from dselectk.experiments.records import RunStore

__all__ = [
    "EXPERIMENTS",
    "add_arguments",
    "experiment_module",
    "experiment_name",
    "rebuild",
    "run",
]

#: experiment name (``dselectk reproduce NAME``, ``config["experiment"]``) → module implementing
#: it. The CLI imports this table (cli → report; report never imports the CLI).
EXPERIMENTS: dict[str, str] = {
    "synthetic": "dselectk.experiments.synthetic",
    "recovery": "dselectk.experiments.recovery",
    "selection": "dselectk.experiments.selection",
    "movielens": "dselectk.experiments.movielens",
    "multi-mnist": "dselectk.experiments.multi_mnist",
    "multi-fashion": "dselectk.experiments.multi_mnist",
    "token-moe": "dselectk.experiments.token_moe",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``dselectk report``."""
    p.add_argument("dir", type=Path, help="results folder (holding runs/ and summary.json)")


def experiment_name(results_dir: Path) -> str:
    """The experiment stored in the run records (falls back to ``summary.json``).

    Raises:
        ValueError: no records, or records of several experiments in one folder.
    """
    names = {r["config"].get("experiment") for r in RunStore(results_dir).load()}
    names.discard(None)
    if not names:
        summary = Path(results_dir) / "summary.json"
        if summary.is_file():
            name = json.loads(summary.read_text(encoding="utf-8")).get("experiment")
            if name:
                return str(name)
        raise ValueError(f"{results_dir}: no run records (runs/*.json) naming an experiment")
    if len(names) > 1:
        raise ValueError(f"{results_dir}: records of several experiments: {sorted(names)}")
    return str(names.pop())


def experiment_module(name: str) -> str:
    """Module implementing experiment ``name`` (:data:`EXPERIMENTS`, else experiments.<name>)."""
    return EXPERIMENTS.get(name, f"dselectk.experiments.{name.replace('-', '_')}")


def rebuild(results_dir: Path) -> str:
    """Call the experiment's ``write_report(results_dir)``; returns the experiment name."""
    results_dir = Path(results_dir)
    if not RunStore(results_dir).load():
        raise ValueError(
            f"{results_dir}: no run records in {results_dir / 'runs'}; the report is rebuilt "
            "from them, so the existing summary.json and report.md are left as they are"
        )
    name = experiment_name(results_dir)
    module = importlib.import_module(experiment_module(name))
    write = getattr(module, "write_report", None)
    if write is None:
        raise ValueError(f"{module.__name__} has no write_report(results_dir)")
    write(results_dir)
    return name


def run(args: argparse.Namespace) -> int:
    """Entry point of ``dselectk report DIR``."""
    name = rebuild(args.dir)  # a ValueError is a user error: the CLI prints it, exit code 2
    print(f"rebuilt the {name} report: {Path(args.dir) / 'report.md'}")
    return 0
