"""The research commands of ``dselectk``: ``reproduce EXPERIMENT`` and ``report DIR``.

Registered with the library's command line through the entry point group ``dselectk.commands``
(see :mod:`dselectk.cli`); each experiment module exposes ``add_arguments(parser)`` and
``run(args) -> int``, and :data:`dselectk_research.report.EXPERIMENTS` lists them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from typing import Any

from dselectk_research import report
from dselectk_research.args import HelpFormatter
from dselectk_research.report import EXPERIMENTS

__all__ = ["register"]


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _reproduce(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args.experiment_module).run(args))


def register(sub: Any) -> None:
    """Add ``reproduce`` and ``report`` to the ``dselectk`` command's sub-parsers ``sub``."""
    rep = sub.add_parser("reproduce", help="reproduce an experiment of the paper")
    rep_sub = rep.add_subparsers(dest="experiment", required=True)
    for name, module in EXPERIMENTS.items():
        if _available(module):
            p = rep_sub.add_parser(
                name, help=f"reproduce the {name} experiment", formatter_class=HelpFormatter
            )
            # (before the flags: an experiment module serving two names reads its name here)
            p.set_defaults(experiment_module=module, experiment_name=name, handler=_reproduce)
            importlib.import_module(module).add_arguments(p)

    rebuild = sub.add_parser(
        "report", help="rebuild report and plots of a results folder", formatter_class=HelpFormatter
    )
    report.add_arguments(rebuild)
    rebuild.set_defaults(handler=report.run)
