"""Command line: ``dselectk demo | reproduce EXPERIMENT | report DIR | bench [ARGS]``.

The CLI parses arguments and calls experiment modules; it holds no logic of its own. Each
experiment module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from dselectk.runtime import tune_allocator

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

    bench = sub.add_parser("bench", help="run the benchmark suite (same as python -m benchmarks)")
    bench.epilog = "Other arguments go to the suite; see `dselectk bench --help-suite`."
    bench.add_argument("--help-suite", action="store_true", help="show the suite's options")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dselectk`` command."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    tune_allocator()
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "demo":
        return int(importlib.import_module("dselectk.experiments.demo").run(args))
    if args.command == "reproduce":
        return int(importlib.import_module(args.experiment_module).run(args))
    if args.command == "report":
        return int(importlib.import_module("dselectk.experiments.report").run(args))
    if args.command == "bench":
        root = Path(__file__).resolve().parents[2]  # repository root (src layout)
        if not (root / "benchmarks" / "suite.py").is_file():
            print("dselectk bench needs a source checkout (benchmarks/ is not installed)")
            return 2
        sys.path.insert(0, str(root))
        suite_args = ["--help"] if args.help_suite else [a for a in extra if a != "--"]
        importlib.import_module("benchmarks.suite").main(suite_args)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
