"""``dselectk reproduce recovery``: flags, the run config, and one cell (a variant: all its
learning rates and repetitions as one vectorized model), run by the shared runner."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dselectk.variants import TRAINER_HPARAMS, Variant
from dselectk_research.args import (
    add_config_arguments,
    check_fits,
    check_tuned_entry,
    config_from_args,
    existing_file,
    file_digest,
    int_at_least,
    positive_float,
    read_json_object,
    seed_value,
    setting,
)
from dselectk_research.data.recovery import FEATURES, NUM_TRUE, UNITS, RecoveryData
from dselectk_research.records import RunStore
from dselectk_research.recovery.model import (
    BASE_HPARAMS,
    BATCH_SIZE,
    EXPERIMENT,
    LRS,
    NUM_EXPERTS,
    VARIANTS,
    train_reps,
)
from dselectk_research.recovery.report import diverged_line, print_table, write_report
from dselectk_research.runner import (
    Recipe,
    add_run_arguments,
    executor_from_args,
    missing,
    run_recipe,
)
from dselectk_research.seeds import derive_seed

POS, NONNEG = int_at_least(1), int_at_least(0)
#: examples of the training and of the validation set (RecoveryData's defaults)
N_EXAMPLES = 10_000
DEFAULT_GATES = ("dselect_k", "dselect_k_search", "topk")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line flags of ``dselectk reproduce recovery``."""
    add_run_arguments(p, out="results/recovery", cells="variants")
    add_config_arguments(p, RecoveryConfig)


@dataclass(frozen=True)
class RecoveryConfig:
    """What a ``reproduce recovery`` command computes (the flags of the same names; ``k``
    None: ``true_experts``). A shape out of range is a ValueError naming the flag."""

    out: Path
    gates: tuple[str, ...] = setting(
        DEFAULT_GATES,
        f"variants, of {', '.join(VARIANTS)} (default: {' '.join(DEFAULT_GATES)})",
        choices=list(VARIANTS),
        metavar="VARIANT",
    )
    experts: int = setting(
        NUM_EXPERTS,
        "experts of the model",
        type=int_at_least(2),
        metavar="N",
    )
    true_experts: int = setting(
        NUM_TRUE, "generating experts (<= --experts)", type=POS, metavar="N"
    )
    k: int | None = setting(
        None,
        "experts a gate selects (default: --true-experts; <= --experts)",
        type=POS,
        metavar="N",
    )
    reps: int | None = setting(None, "repetitions (default: 20; with --full 100)", type=POS)
    epochs: int | None = setting(None, "override the epochs", type=POS)
    seed: int = setting(0, "base seed (init, shuffling)", type=seed_value)
    data_seed: int = setting(0, "seed of the generated data", type=seed_value)
    tuned: Path | None = setting(  # noqa: RUF009 (a dataclasses.field)
        None, "tuning record to use (default: tuned_recovery.json)", type=existing_file
    )
    record_every: int = setting(10, "trajectory sampling (steps)", type=NONNEG)
    lrs: tuple[float, ...] | None = setting(
        None,
        "learning-rate grid (default: 1e-1 1e-2 1e-3; with --full 1e-1 ... 1e-5)",
        type=positive_float,
        nargs="+",
    )
    full: bool = setting(False, "100 repetitions, 5 learning rates")
    telemetry: bool = False

    def __post_init__(self) -> None:
        if self.k is None:
            object.__setattr__(self, "k", self.true_experts)
        if self.experts < 2:
            raise ValueError(f"argument --experts: expected an integer >= 2, got {self.experts}")
        for flag, value in (("--true-experts", self.true_experts), ("--k", self.k)):
            if not 1 <= int(value or 0) <= self.experts:
                raise ValueError(
                    f"argument {flag}: expected an integer in [1, --experts = {self.experts}], "
                    f"got {value}"
                )
        runs = self.runs_per_variant
        check_fits(
            runs * self.experts * (2 * N_EXAMPLES * UNITS + FEATURES * UNITS) * 4.0,
            f"--reps × --lrs ({runs} runs of a variant, trained as one model) × --experts "
            f"{self.experts} (frozen expert outputs of the train and validation sets)",
        )

    @property
    def repetitions(self) -> int:
        return self.reps if self.reps is not None else (100 if self.full else 20)

    @property
    def lr_grid(self) -> tuple[float, ...]:
        return tuple(self.lrs or (LRS if self.full else LRS[:3]))

    @property
    def runs_per_variant(self) -> int:
        """Repetitions × learning rates: the runs a variant trains as one vectorized model."""
        return self.repetitions * len(self.lr_grid)

    @property
    def shape(self) -> dict[str, int]:
        return {"experts": self.experts, "true": self.true_experts, "k": int(self.k or 0)}


def tuned_hparams(
    variant: Variant, path: str | Path | None = None, epochs: int | None = None
) -> dict[str, Any]:
    """The variant's hyperparameters: the :data:`BASE_HPARAMS` its gate declares, then its entry
    in the tuning record (``path``, default the shipped ``tuned_recovery.json``), checked, then
    ``epochs`` when given. A user's file without an entry for the variant is a ValueError,
    never a silent fallback."""
    if path:
        rec, _ = read_json_object(path, "--tuned")
        where = f"--tuned {path}"
    else:
        src = resources.files("dselectk_research").joinpath("tuned_recovery.json")
        rec, where = json.loads(src.read_text(encoding="utf-8")), src.name
    table = rec.get("hparams")
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ValueError(f'{where}: expected {{"hparams": {{variant: {{name: value}}}}}}')
    if path and variant.tuned_name not in table:
        raise ValueError(
            f"{where}: no hyperparameters for {variant.name} (hparams.{variant.tuned_name}); "
            f"it has {sorted(table) or 'none'}"
        )
    entry = table.get(variant.tuned_name, {})
    if path:
        entry = check_tuned_entry(f"{where}: hparams.{variant.tuned_name}", entry)
    base = {k: v for k, v in BASE_HPARAMS.items() if k in (*TRAINER_HPARAMS, *variant.spec.hparams)}
    hp = variant.check_hparams({**base, **entry}, f"{where}: hparams.{variant.tuned_name}")
    return hp if epochs is None else {**hp, "epochs": epochs}


def init_seed(seed: int, rep: int) -> int:
    """Repetition r's seed: the same for every variant and learning rate (paired comparison);
    :func:`~dselectk_research.seeds.derive_seed` over the repetition."""
    return derive_seed(seed, (7919, rep), (1, 17))


def _record_config(
    config: RecoveryConfig, variant: Variant, hp: dict[str, Any], rep: int, init_seed: int
) -> dict[str, Any]:
    return {
        "experiment": EXPERIMENT,
        "phase": "final",
        "gate": variant.name,
        "variant": variant.identity(),
        "shape": config.shape,
        "lr": float(hp["lr"]),
        "hparams": dict(sorted(hp.items())),
        "rep": rep,
        "init_seed": init_seed,
        "shuffle_seed": config.seed,
        "batch_size": BATCH_SIZE,
        "data": {"seed": config.data_seed, "n_train": N_EXAMPLES, "n_val": N_EXAMPLES},
    }


def run_cell(
    config: RecoveryConfig, gate: str, data: RecoveryData, progress: bool, store: RunStore
) -> dict[str, Any]:
    """One variant: every (learning rate, repetition) not recorded yet, trained in one
    vectorized model (per-row Adam learning rates); repetition 0's trajectory is kept per lr."""
    variant = VARIANTS[gate]
    hp = tuned_hparams(variant, config.tuned, config.epochs)
    tuned, reps = config.tuned, config.repetitions
    source = f"--tuned {tuned} (sha256 {file_digest(tuned)})" if tuned else "tuned_recovery.json"
    selection = {"hparams": hp, "lrs": [float(v) for v in config.lr_grid], "source": source}
    jobs = [(lr, r, init_seed(config.seed, r)) for lr in config.lr_grid for r in range(reps)]
    cfgs = [_record_config(config, variant, {**hp, "lr": float(lr)}, r, s) for lr, r, s in jobs]
    todo = missing(store, cfgs)
    if not todo:
        return selection
    telemetry = Path(config.out) / "telemetry" / gate if config.telemetry else None
    metrics, trajs = train_reps(
        variant,
        hp,  # (the learning rates are lrs)
        data,
        [jobs[i][2] for i in todo],
        shuffle_seed=config.seed,
        experts=config.experts,
        k=config.k,
        lrs=[jobs[i][0] for i in todo],
        record_every=config.record_every,
        record_reps=[j for j, i in enumerate(todo) if jobs[i][1] == 0],
        progress=progress,
        desc=f"{gate} ({len(todo)} runs)",
        telemetry_dir=telemetry,
    )
    for j, i in enumerate(todo):
        extra: dict[str, Any] = {"trajectory": trajs[j]} if j in trajs else {}
        loss = metrics[j].get("val_loss")
        if loss is None or not math.isfinite(float(loss)):
            extra["diverged"] = True  # counted in the report; its lr is never selected
        store.save(cfgs[i], metrics[j], **extra)
    return selection


def _load_data(config: RecoveryConfig) -> RecoveryData:
    return RecoveryData(config.data_seed, num_true=config.true_experts)


def _data_key(config: RecoveryConfig) -> tuple[int, int]:
    return config.data_seed, config.true_experts


def _planned_runs(config: RecoveryConfig, gate: str) -> int:
    return config.runs_per_variant


def recipe(config: RecoveryConfig) -> Recipe:
    """One cell per variant, for the shared runner."""
    return Recipe(
        list(config.gates),
        run_cell,
        _load_data,
        _data_key,
        str,
        write_report=write_report,
        print_table=print_table,
        diverged=diverged_line,
        planned_runs=_planned_runs,
        experiment=EXPERIMENT,
    )


def run(args: argparse.Namespace) -> int:
    """Run (or resume) every variant × learning rate × repetition, then write the report."""
    config = config_from_args(RecoveryConfig, args)
    for gate in config.gates:  # a bad or incomplete --tuned is refused before any training
        tuned_hparams(VARIANTS[gate], config.tuned)
    return run_recipe(recipe(config), config, executor_from_args(args, threads=args.threads))
