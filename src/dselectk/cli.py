"""Command line: ``dselectk demo | reproduce EXPERIMENT | report DIR | bench``.

The CLI parses arguments and calls experiment modules; it holds no logic of its own. Each
experiment module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

__all__ = ["main"]

#: ``dselectk reproduce NAME`` → module implementing it
EXPERIMENTS: dict[str, str] = {
    "synthetic": "dselectk.experiments.synthetic",
    "recovery": "dselectk.experiments.recovery",
    "movielens": "dselectk.experiments.movielens",
    "multi-mnist": "dselectk.experiments.multi_mnist",
    "multi-fashion": "dselectk.experiments.multi_mnist",
}


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dselectk", description="DSelect-k gates for mixture-of-experts models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="train a small multi-gate MoE with DSelect-k on generated data"
    )
    importlib.import_module("dselectk.experiments.demo").add_arguments(demo)

    rep = sub.add_parser("reproduce", help="reproduce an experiment of the paper")
    rep_sub = rep.add_subparsers(dest="experiment", required=True)
    for name, module in EXPERIMENTS.items():
        if _available(module):
            p = rep_sub.add_parser(name, help=f"reproduce the {name} experiment")
            importlib.import_module(module).add_arguments(p)
            p.set_defaults(experiment_module=module, experiment_name=name)

    if _available("dselectk.experiments.report"):
        report = sub.add_parser("report", help="rebuild report and plots of a results folder")
        importlib.import_module("dselectk.experiments.report").add_arguments(report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dselectk`` command."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return int(importlib.import_module("dselectk.experiments.demo").run(args))
    if args.command == "reproduce":
        return int(importlib.import_module(args.experiment_module).run(args))
    if args.command == "report":
        return int(importlib.import_module("dselectk.experiments.report").run(args))
    return 2


if __name__ == "__main__":
    sys.exit(main())
