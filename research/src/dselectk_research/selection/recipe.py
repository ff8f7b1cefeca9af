"""``dselectk reproduce selection``: flags, the run config, the dry run (plan and cost) and the
recipe."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dselectk_research.args import add_config_arguments, int_at_least, positive_float, setting
from dselectk_research.recovery import BATCH_SIZE
from dselectk_research.runner import Recipe, add_run_arguments, executor_from_args, run_recipe
from dselectk_research.selection import study as S
from dselectk_research.selection.report import diverged_line, print_table, write_report
from dselectk_research.synthetic import paper_grid

#: the dry run's cost model, seconds on one core of the development machine under load ~6 on
#: 2 cores (fitted on two 32/3 cells of the quick form): per training call, steps × (A + B·members)
#: + probe passes × (C + D·members); an estimate, not a promise
A, B, C, D = 0.01, 0.0002, 0.02, 0.002
#: C.1: seconds per step, E + F · members · T/32 (a rough estimate, see :func:`_c1_cost`;
#: scaled to the quick T = 64 cells' 8 CPU-minutes on the idle development machine)
E, F = 0.0007, 0.00027


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


@dataclass(frozen=True)
class SelectionConfig:
    """What a ``reproduce selection`` command computes: recovery at ``shapes`` and Appendix C.1
    at ``tasks`` (either may be empty; the flags' types check the shapes, tasks and arms)."""

    out: Path
    arms: tuple[str, ...] = setting(
        tuple(S.ARMS),
        f"arms, of {', '.join(S.ARMS)} (default: all)",
        choices=list(S.ARMS),
        metavar="ARM",
    )
    shapes: tuple[tuple[int, int], ...] = setting(
        S.QUICK_SHAPES,
        "shapes EXPERTS/TRUE, k = TRUE <= EXPERTS/4 (default: 16/2 16/4 32/3; "
        "with --full 16, 32, 64 experts × 2, 3, 4, 6 true)",
        type=shape_arg,
        default=None,
        metavar="N/T",
    )
    reps: int = setting(
        S.QUICK_REPS,
        f"repetitions (default: {S.QUICK_REPS}; with --full {S.FULL_REPS})",
        type=int_at_least(2),
        default=None,
    )
    lrs: tuple[float, ...] = setting(
        S.QUICK_LRS,
        "learning-rate grid (default: 1e-1 1e-2 1e-3; with --full 1e-1 ... 1e-5)",
        type=positive_float,
        default=None,
    )
    epochs: int | None = setting(
        None,
        "recovery: override the 50 epochs (equal-budget arms add theirs)",
        type=int_at_least(1),
    )
    tasks: tuple[int, ...] = setting(
        S.QUICK_TASKS,
        "Appendix C.1 cells at T tasks (default: 32 64; with --full 32 64 128); "
        "'--tasks' alone: none",
        nargs="*",
        type=int,
        choices=(16, 32, 64, 128),
        default=None,
        metavar="T",
    )
    c1: S.C1Sizes = S.C1_QUICK

    def __post_init__(self) -> None:
        for n, t in self.shapes:
            S.data_seed(n, t)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line flags of ``dselectk reproduce selection``."""
    add_run_arguments(p, out="results/selection", threads=1, jobs=0, cells="(arm, shape) cells")
    add_config_arguments(p, SelectionConfig)
    p.add_argument(
        "--full",
        action="store_true",
        help="every shape, 100 repetitions, 5 lrs; C.1 at T = 32, 64, 128 on the paper's splits "
        "over its whole grid",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the plan and its cost, run nothing"
    )


def config_of(args: argparse.Namespace) -> SelectionConfig:
    """The run config: the flags given, else the quick (or ``--full``) study's values."""
    full = bool(args.full)
    return SelectionConfig(
        out=args.out,
        arms=tuple(args.arms),
        shapes=tuple(args.shapes or (S.FULL_SHAPES if full else S.QUICK_SHAPES)),
        reps=args.reps or (S.FULL_REPS if full else S.QUICK_REPS),
        lrs=tuple(args.lrs or (S.FULL_LRS if full else S.QUICK_LRS)),
        epochs=args.epochs,
        tasks=tuple(
            (S.FULL_TASKS if full else S.QUICK_TASKS) if args.tasks is None else args.tasks
        ),
        c1=S.C1_FULL if full else S.C1_QUICK,
    )


def plan_text(config: SelectionConfig) -> str:
    """The plan (cells, runs) and its cost estimate."""
    epochs = config.epochs or 50
    per_epoch = math.ceil(S.N_TRAIN / BATCH_SIZE)
    runs = probe = 0
    sec = c1_sec = c1_runs = 0.0
    for arm_name, study, n, t in S.cells(config):
        if study == "c1":
            runs_, sec_ = _c1_cost(config, arm_name, n)
            c1_runs, c1_sec = c1_runs + runs_, c1_sec + sec_
            continue
        bound = S.max_probe_passes(S.ARMS[arm_name], n, t)
        arm_steps = S.hparams_of(config, S.ARMS[arm_name], (n, t))["epochs"] * per_epoch
        for members in (config.reps * len(config.lrs), config.reps):  # tuning, test retrain
            runs += members
            probe += members * bound
            sec += arm_steps * (A + B * members) + bound * (C + D * members)
    sec += c1_sec
    lines = [
        S.PROTOCOL,
        "Plan:",
        f"  arms {', '.join(config.arms)}",
        f"  recovery shapes {' '.join(f'{n}/{t}' for n, t in config.shapes)} (data seeds "
        f"{', '.join(str(S.data_seed(n, t)) for n, t in config.shapes)})",
        f"  {config.reps} repetitions × lrs {list(config.lrs)} + the selected lr's test retrain",
        f"  {len(S.cells(config))} cells, {int(runs)} runs, {epochs} epochs "
        f"({epochs * per_epoch} steps) each (equal-budget arms: more, protocol item 5)",
        f"  probe passes at most {int(probe):,} (member × candidate evaluations)",
        f"  C.1 at T = {', '.join(map(str, config.tasks)) or 'none'}: {int(c1_runs)} runs "
        f"(tuning trials × sampled configurations, then {config.c1.reps} repetitions), "
        f"{config.c1.n_train:,} training examples",
        f"  estimated cost {sec / 60:.0f} CPU-minutes on one core (about {sec / 120:.0f} min "
        "on 2 idle cores); split over cells by --executor slurm",
    ]
    return "\n".join(lines)


def _c1_cost(config: SelectionConfig, arm_name: str, tasks: int) -> tuple[int, float]:
    """Runs and estimated seconds of a C.1 cell: tuning members × their epochs, then the
    repetitions at the grid's mean epochs, each step costing E + F·members·T/32."""
    arm, sz = S.C1_ARMS[arm_name], config.c1
    grid = paper_grid(arm)
    points = math.prod(len(v) for k, v in grid.items() if k != "epochs")
    epochs = grid["epochs"]
    steps = math.ceil(sz.n_train / BATCH_SIZE)
    dependent = bool(arm.schedules) or arm.search is not None
    if sz.points is not None:
        points = min(points, sz.points)
    members = points * sz.trials * (len(epochs) if dependent else 1)
    tune_epochs = sum(epochs) / len(epochs) if dependent else max(epochs)
    scale = tasks / 32
    sec = steps * tune_epochs * (E * (len(epochs) if dependent else 1) + F * members * scale)
    sec += steps * sum(epochs) / len(epochs) * (E + F * sz.reps * scale)
    return members * (1 if dependent else len(epochs)) + sz.reps, sec


def _load_data(config: SelectionConfig) -> Any:
    """The C.1 data when the command has C.1 cells (recovery cells make their own, cheaply)."""
    return S.load_c1(config.c1) if config.tasks else None


def _data_key(config: SelectionConfig) -> Any:
    return (config.c1, bool(config.tasks))


def _cost(cell: S.Cell) -> float:
    arm, study, a, b = cell
    if study == "c1":
        return 10_000.0 * a  # the largest cells first
    return S.max_probe_passes(S.ARMS[arm], a, b) + 1


def recipe(config: SelectionConfig) -> Recipe:
    """One cell per (arm, shape), for the shared runner."""
    return Recipe(S.cells(config), S.run_cell, _load_data, _data_key, S.cell_name, cost=_cost,
                  write_report=write_report, print_table=print_table,
                  diverged=diverged_line, experiment=S.EXPERIMENT)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run (or resume) every cell, then write the report; ``--dry-run``: the plan only."""
    config = config_of(args)
    if args.dry_run:
        print(plan_text(config))
        return 0
    print(S.PROTOCOL)
    return run_recipe(recipe(config), config, executor_from_args(args, threads=args.threads))
