"""``dselectk reproduce selection``: flags, the dry run (plan and cost) and the recipe."""

from __future__ import annotations

import argparse
import math
from typing import Any

from dselectk.experiments.args import int_at_least, positive_float
from dselectk.experiments.executors import executor_from_args
from dselectk.experiments.recovery.model import BATCH_SIZE
from dselectk.experiments.runner import Recipe, add_run_arguments, run_recipe
from dselectk.experiments.selection import study as S
from dselectk.experiments.selection.report import print_table, write_report

__all__ = ["add_arguments", "config_of", "plan_text", "recipe", "run"]

#: the dry run's cost model, seconds on one core of the development machine under load ~6 on
#: 2 cores (fitted on two 32/3 cells of the quick form): per training call, steps × (A + B·members)
#: + probe passes × (C + D·members); an estimate, not a promise
A, B, C, D = 0.01, 0.0002, 0.02, 0.002


def shape_arg(text: str) -> tuple[int, int]:
    """An argparse type: ``EXPERTS/TRUE`` with 1 <= TRUE <= EXPERTS/4 (k = TRUE)."""
    try:
        n, t = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected EXPERTS/TRUE such as 16/4, got {text!r}"
        ) from None
    if not 1 <= t <= n // 4:
        raise argparse.ArgumentTypeError(f"{text}: need 1 <= TRUE <= EXPERTS/4")
    return n, t


#: flag, keyword arguments (besides --out and the shared run and executor flags)
_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--arms", dict(nargs="+", default=list(S.ARMS), choices=list(S.ARMS), metavar="ARM",
                    help=f"arms, of {', '.join(S.ARMS)} (default: all)")),
    ("--shapes", dict(nargs="+", type=shape_arg, default=None, metavar="N/T",
                      help="shapes EXPERTS/TRUE, k = TRUE <= EXPERTS/4 (quick: 16/2 16/4 32/3; "
                      "--full: 16, 32, 64 experts × 2, 3, 4, 6 true)")),
    ("--reps", dict(type=int_at_least(2), default=None,
                    help=f"repetitions (quick {S.QUICK_REPS}, full {S.FULL_REPS})")),
    ("--lrs", dict(type=positive_float, nargs="+", default=None,
                   help="learning-rate grid (quick: 1e-1 1e-2 1e-3; --full: 1e-1 ... 1e-5)")),
    ("--epochs", dict(type=int_at_least(1), default=None, help="override the 50 epochs")),
    ("--full", dict(action="store_true", help="every shape, 100 repetitions, 5 lrs")),
    ("--dry-run", dict(action="store_true", help="print the plan and its cost, run nothing")),
]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line flags of ``dselectk reproduce selection``."""
    add_run_arguments(p, out="results/selection", threads=1, jobs=0, cells="(arm, shape) cells")
    for flag, kw in _FLAGS:
        p.add_argument(flag, **kw)


def config_of(args: argparse.Namespace) -> S.SelectionConfig:
    full = bool(args.full)
    return S.SelectionConfig(
        out=args.out,
        arms=tuple(args.arms),
        shapes=tuple(args.shapes or (S.FULL_SHAPES if full else S.QUICK_SHAPES)),
        reps=args.reps or (S.FULL_REPS if full else S.QUICK_REPS),
        lrs=tuple(args.lrs or (S.FULL_LRS if full else S.QUICK_LRS)),
        epochs=args.epochs,
    )


def _max_probe_passes(arm: Any, n: int, k: int) -> int:
    """Upper bound of a run's probe passes: per search, 1 + sweeps (2) × k selectors × n."""
    plan = arm.search
    if plan is None:
        return 0
    searches = len(set(plan.at) | ({plan.binarize} if plan.binarize else set()))
    return searches * (1 + 2 * k * n)


def plan_text(config: S.SelectionConfig) -> str:
    """The plan (cells, runs) and its cost estimate."""
    epochs = config.epochs or 50
    steps = epochs * math.ceil(S.N_TRAIN / BATCH_SIZE)
    runs = probe = 0
    sec = 0.0
    lines = [S.PROTOCOL, "Plan:"]
    for arm_name, n, t in S.cells(config):
        bound = _max_probe_passes(S.ARMS[arm_name], n, t)
        for members in (config.reps * len(config.lrs), config.reps):  # tuning, test retrain
            runs += members
            probe += members * bound
            sec += steps * (A + B * members) + bound * (C + D * members)
    lines += [
        f"  arms {', '.join(config.arms)}",
        f"  shapes {' '.join(f'{n}/{t}' for n, t in config.shapes)} (data seeds "
        f"{', '.join(str(S.data_seed(n, t)) for n, t in config.shapes)})",
        f"  {config.reps} repetitions × lrs {list(config.lrs)} + the selected lr's test retrain",
        f"  {len(S.cells(config))} cells, {int(runs)} runs, {epochs} epochs ({steps} steps) each",
        f"  probe passes at most {int(probe):,} (member × candidate evaluations)",
        f"  estimated cost {sec / 60:.0f} CPU-minutes on one core (about {sec / 120:.0f} min "
        "on 2 idle cores); split over cells by --executor slurm",
    ]
    return "\n".join(lines)


def _load_data(config: S.SelectionConfig) -> None:
    return None  # each cell generates its shape's data (cheap)


def _data_key(config: S.SelectionConfig) -> int:
    return 0


def _cost(cell: tuple[str, int, int]) -> float:
    return _max_probe_passes(S.ARMS[cell[0]], cell[1], cell[2]) + 1


def recipe(config: S.SelectionConfig) -> Recipe:
    """One cell per (arm, shape), for the shared runner."""
    return Recipe(S.cells(config), S.run_cell, _load_data, _data_key, S.cell_name, cost=_cost,
                  write_report=write_report, print_table=print_table)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run (or resume) every cell, then write the report; ``--dry-run``: the plan only."""
    config = config_of(args)
    if args.dry_run:
        print(plan_text(config))
        return 0
    print(S.PROTOCOL)
    return run_recipe(recipe(config), config, executor_from_args(args, threads=args.threads))
