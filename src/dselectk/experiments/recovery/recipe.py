"""``dselectk reproduce recovery``: flags and one cell (a gate: all its learning rates and
repetitions as one vectorized model), run by the shared runner."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dselectk.experiments.args import config_from_args, int_at_least, positive_float
from dselectk.experiments.records import RunStore
from dselectk.experiments.recovery.model import (
    BASE_HPARAMS,
    BATCH_SIZE,
    EXPERIMENT,
    GATES,
    LRS,
    SEARCHES,
    RecoveryData,
    generate_data,
    train_reps,
)
from dselectk.experiments.recovery.report import print_table, write_report
from dselectk.experiments.runner import (
    Recipe,
    add_executor_arguments,
    cell_str,
    executor_from_args,
    missing,
    run_recipe,
)
from dselectk.io import json_safe

__all__ = ["RecoveryConfig", "add_arguments", "load_tuned", "recipe", "run", "run_cell"]


def load_tuned(path: str | Path | None = None) -> dict[str, Any]:
    """The shipped tuning record ``tuned_recovery.json`` (or ``path``)."""
    if path is not None:
        return dict(json.loads(Path(path).read_text(encoding="utf-8")))
    text = resources.files("dselectk.experiments").joinpath("tuned_recovery.json").read_text()
    return dict(json.loads(text))


def _init_seed(seed: int, rep: int) -> int:
    """Repetition r's seed: the same for every gate and learning rate (paired comparison)."""
    return (int(seed) * 1_000_003 + rep * 7919 + 17) % 2**31


POS, NONNEG = int_at_least(1), int_at_least(0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line flags of ``dselectk reproduce recovery``."""
    p.add_argument("--out", type=Path, default=Path("results/recovery"), help="results folder")
    p.add_argument(
        "--gates",
        nargs="+",
        default=["dselect_k", "dselect_k_search", "topk"],
        choices=sorted(GATES),
        help="gates (default: the paper's DSelect-k, DSelect-k + swap local search, Top-k)",
    )
    p.add_argument("--reps", type=POS, default=None, help="repetitions (quick 20, full 100)")
    p.add_argument(
        "--lrs",
        type=positive_float,
        nargs="+",
        default=None,
        help="learning-rate grid (quick: 1e-1 1e-2 1e-3; --full: 1e-1 ... 1e-5)",
    )
    p.add_argument("--epochs", type=POS, default=None, help="override the epochs")
    p.add_argument("--seed", type=NONNEG, default=0, help="base seed (init, shuffling)")
    p.add_argument("--data-seed", type=NONNEG, default=0, help="seed of the generated data")
    p.add_argument("--full", action="store_true", help="100 repetitions")
    p.add_argument("--tuned", type=Path, default=None, help="tuning record to use")
    p.add_argument("--record-every", type=NONNEG, default=10, help="trajectory sampling (steps)")
    p.add_argument(
        "--threads",
        type=POS,
        default=1,
        help="torch CPU threads (default 1: these models are tiny and overhead-bound)",
    )
    p.add_argument(
        "--jobs",
        type=NONNEG,
        default=0,
        help="worker processes, each running whole gates (default 0: one per core / --threads, "
        "at most one per gate); the records are the same as in one process",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument(
        "--telemetry",
        action="store_true",
        help="log routing telemetry (binary S(Z), selector collisions, entropy, experts) of every "
        "repetition to OUT/telemetry/GATE/ (TensorBoard if installed, else JSON lines)",
    )
    add_executor_arguments(p)


@dataclass(frozen=True)
class RecoveryConfig:
    """What a ``reproduce recovery`` command computes (its run config; the flags of the same
    names)."""

    out: Path
    gates: tuple[str, ...]
    reps: int | None = None
    lrs: tuple[float, ...] | None = None
    epochs: int | None = None
    seed: int = 0
    data_seed: int = 0
    full: bool = False
    tuned: Path | None = None
    record_every: int = 10
    telemetry: bool = False


def _config(
    gate: str, hp: Mapping[str, Any], rep: int, seed: int, init_seed: int, data_seed: int
) -> dict[str, Any]:
    return {
        "experiment": EXPERIMENT,
        "phase": "final",
        "gate": gate,
        "lr": float(hp["lr"]),
        "hparams": dict(sorted(hp.items())),
        "rep": rep,
        "init_seed": init_seed,
        "shuffle_seed": seed,
        "batch_size": BATCH_SIZE,
        "data": {"seed": data_seed, "n_train": 10_000, "n_val": 10_000},
        # the search schedule is part of a search variant's identity (other gates: unchanged)
        **({"search": json_safe(SEARCHES[gate])} if gate in SEARCHES else {}),
    }


def run_cell(
    config: RecoveryConfig, gate: str, data: RecoveryData, progress: bool
) -> dict[str, Any]:
    """One gate: every (learning rate, repetition) not recorded yet, trained in one vectorized
    model (per-row Adam learning rates); repetition 0's trajectory is kept for each lr."""
    store = RunStore(config.out)
    reps = config.reps if config.reps is not None else (100 if config.full else 20)
    tuned = load_tuned(config.tuned)
    lrs = config.lrs or (LRS if config.full else LRS[:3])
    hp = dict(BASE_HPARAMS)
    hp.update(tuned.get("hparams", {}).get(gate, {}))
    if config.epochs is not None:
        hp["epochs"] = config.epochs
    selection = {"hparams": hp, "lrs": [float(v) for v in lrs], "source": "tuned_recovery.json"}
    seeds = [_init_seed(config.seed, r) for r in range(reps)]
    jobs = [(lr, r, s) for lr in lrs for r, s in enumerate(seeds)]
    cfgs = [
        _config(gate, {**hp, "lr": float(lr)}, r, config.seed, s, config.data_seed)
        for lr, r, s in jobs
    ]
    todo = missing(store, cfgs)
    if not todo:
        return selection
    first = [i for i in todo if jobs[i][1] == 0]
    metrics, trajs = train_reps(
        gate,
        {**hp, "lr": float(jobs[todo[0]][0])},
        data,
        [jobs[i][2] for i in todo],
        shuffle_seed=config.seed,
        lrs=[jobs[i][0] for i in todo],
        record_every=config.record_every,
        record_reps=[todo.index(i) for i in first],
        progress=progress,
        desc=f"{gate} ({len(todo)} runs)",
        telemetry_dir=Path(config.out) / "telemetry" / gate if config.telemetry else None,
    )
    for j, i in enumerate(todo):
        extra = {"trajectory": trajs[j]} if j in trajs else {}
        store.save(cfgs[i], metrics[j], **extra)
    return selection


def _load_data(config: RecoveryConfig) -> RecoveryData:
    return generate_data(config.data_seed)


def _data_key(config: RecoveryConfig) -> int:
    return int(config.data_seed)


def recipe(config: RecoveryConfig) -> Recipe:
    """One cell per gate, for the shared runner."""
    return Recipe(
        cells=list(config.gates),
        run_cell=run_cell,
        load_data=_load_data,
        data_key=_data_key,
        cell_name=cell_str,
        write_report=write_report,
        print_table=print_table,
    )


def run(args: argparse.Namespace) -> int:
    """Run (or resume) every gate × learning rate × repetition, then write the report."""
    config = config_from_args(RecoveryConfig, args)
    threads = max(1, int(getattr(args, "threads", 1) or 1))
    return run_recipe(recipe(config), config, executor_from_args(args, threads=threads))
