"""What a real-data experiment is: its gates (:data:`VARIANTS`), :class:`Splits` and the
:class:`Experiment` a recipe fills; the shared code only sees the spec, never the recipes."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from dselectk.gates import Gate
from dselectk.optim import OPTIMIZER_DEFAULTS
from dselectk.training import TaskData
from dselectk.variants import TRAINER_HPARAMS, Variant
from dselectk_research.args import int_at_least, positive_float, seed_value, setting
from dselectk_research.catalog import CATALOG, hparam_setting
from dselectk_research.keras_init import INITS
from dselectk_research.records import EXPLOSION_FACTOR

#: hyperparameters of a run that shape the model, not the gate's declared ones (``k`` is the
#: gate's structure: it goes to the constructor unchecked)
MODEL_HPARAMS = ("k", "units", "dense_layers")
POS = int_at_least(1)


@dataclass(frozen=True)
class GateChoice:
    """One row of the real-data tables: a gate :class:`~dselectk.variants.Variant`, static or
    per-example (its gates see the example), or the shared-bottom baseline (``variant`` None: a
    model of its own, not a gate)."""

    name: str
    label: str
    variant: Variant | None = None
    per_example: bool = False

    def check_hparams(self, hparams: Mapping[str, Any], where: str = "") -> None:
        """A ValueError on a key that is neither a trainer, a model (:data:`MODEL_HPARAMS`) nor
        a declared gate hyperparameter, or on a declared value out of its range."""
        rest = {k: v for k, v in hparams.items() if k not in MODEL_HPARAMS}
        if self.variant is None:
            rest = {k: v for k, v in rest.items() if k not in TRAINER_HPARAMS}
            if rest:
                raise ValueError(f"{where or self.name}: the shared bottom takes no {sorted(rest)}")
            return
        self.variant.check_hparams(rest, where)

    def build(
        self, num_experts: int, hparams: Mapping[str, Any], num_gates: int, in_features: int
    ) -> Gate:
        """The bank of ``num_gates`` gates (``in_features``: what a per-example gate sees)."""
        if self.variant is None:
            raise ValueError("the shared bottom is a model, not a gate")
        structure: dict[str, Any] = {"num_gates": num_gates}
        structure["in_features"] = in_features if self.per_example else None
        if "k" in hparams:
            structure["k"] = int(hparams["k"])
        return self.variant.build(num_experts, hparams=hparams, **structure)


def _choice(name: str, per_example: bool = False) -> GateChoice:
    variant = CATALOG[name]
    return GateChoice(name, variant.label, variant, per_example)


#: the gates of Tables 1, 2, C.2 and C.3, in report order (the gates' variants are rows of
#: :mod:`dselectk_research.catalog`; the shared bottom is a model of its own)
VARIANTS: dict[str, GateChoice] = {
    c.name: c
    for c in (
        _choice("dselect_k_static"),
        _choice("topk_static"),
        _choice("gumbel_softmax"),
        _choice("dselect_k_per_example", per_example=True),
        _choice("topk_per_example", per_example=True),
        _choice("softmax"),
        GateChoice("shared_bottom", "Shared Bottom"),
    )
}


def per_gate(table: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A recipe's table by registry gate (``shared_bottom`` for the baseline) spread over
    :data:`VARIANTS`: the static and per-example variants of a gate share its row."""
    return {
        name: dict(table[c.variant.gate if c.variant else name]) for name, c in VARIANTS.items()
    }


def label(gate: str) -> str:
    """What the reports call ``gate`` (the name itself when unknown)."""
    return VARIANTS[gate].label if gate in VARIANTS else gate


@dataclass
class Splits:
    """Train/validation/test task data plus what the model builder needs to know."""

    train: TaskData
    val: TaskData
    test: TaskData
    meta: dict[str, Any] = field(default_factory=dict)
    """Model-building facts (vocabulary sizes, ...); also saved in the summary."""
    config: dict[str, Any] = field(default_factory=dict)
    """Data settings recorded in every run config (the resume identity of the data)."""


@dataclass(frozen=True)
class Experiment:
    """How one real-data experiment is run and reported (``realdata.recipe.build_recipe`` makes
    the shared runner's :class:`~dselectk_research.runner.Recipe` from it). Every callable
    is a module-level function: the spec is sent to the sweep's worker processes."""

    name: str  # CLI name, also ``config["experiment"]`` of every record
    setting_key: str | None  # the per-setting config key (e.g. "alpha"), or None
    losses: Sequence[Any]  # per-task losses of :func:`~dselectk.training.train`
    task_names: Sequence[str]
    optimizer: str  # "adagrad" / "adam"
    batch_size: int
    quick_hparams: Mapping[str, Mapping[str, Any]]  # gate → hyperparameters of quick mode
    grid: Mapping[str, Mapping[str, Sequence[Any]]]  # gate → the ``--full`` random grid
    select: str  # the tuning metric: "min_loss" (weighted val loss) or "max_accuracy"
    build_model: Callable[[str, Mapping[str, Any], Mapping[str, Any]], nn.Module]
    expert_flops: Callable[[Mapping[str, Any], Mapping[str, Any]], float]  # one expert, one x
    load_data: Callable[[Any], Splits]  # once per process of the sweep
    data_fields: tuple[str, ...]  # the run-config fields that decide the data
    # the report's "Setup and choices": the template ``templates/<template>.md`` and
    # (run config, data) → its recipe-specific values (see ``realdata.recipe.prepare``)
    template: str
    notes: Callable[[Any, Splits], dict[str, Any]]
    title: str
    # (rows keyed by (setting, gate), settings, reference or None) → the paper tables' lines
    tables: Callable[[Mapping[tuple[Any, str], Mapping[str, Any]], Sequence[Any], Any], list[str]]
    paper_c2: Mapping[str, Mapping[str, float]]  # Table C.2 column → {"pct", "flops"}
    c2_column: str  # a setting's Table C.2 column (``str.format`` of the setting)
    quick_reps: int = 2
    # setting → weights of the tasks' losses in the summed loss (None: 1 each)
    task_weights: Callable[[Any], list[float]] | None = None
    # (run config, data) → metrics of non-neural predictors, cached per data configuration
    reference: Callable[[Any, Splits], dict[str, Any]] | None = None
    init: str = "keras"  # :func:`~dselectk_research.keras_init.keras_init_` or torch's
    optimizer_defaults: str = "tf"  # ``defaults`` of :func:`~dselectk.optim.make_optimizer`


@dataclass(frozen=True)
class RealDataConfig:
    """The run config of a real-data command (the flags every real-data experiment shares,
    resolved); each recipe subclasses it with its own flags."""

    out: Path
    data_dir: Path | None = setting(  # noqa: RUF009 (a dataclasses.field)
        None, "data folder ($DSELECTK_DATA or ~/.cache)", type=Path
    )
    repetitions: int | None = setting(
        None,
        "repetitions per gate and setting (default: MovieLens 3, Multi-MNIST 1; with --full 100)",
        "--reps",
        type=POS,
    )
    seed: int = setting(0, "seed of the data and of the runs", type=seed_value)
    gates: tuple[str, ...] = setting(  # an absent --gates: resolved by ``config_of``
        tuple(VARIANTS),
        "gates (default: all; MovieLens without --full: static DSelect-k, static Top-k, softmax)",
        choices=list(VARIANTS),
        default=None,
    )
    full: bool = setting(False, "paper protocol: Appendix D grid search, 100 reps")
    epochs: int | None = setting(None, "override the epochs of every run", type=POS)
    lr: float | None = setting(None, "override the learning rate", type=positive_float)
    gamma: float | None = hparam_setting(
        "gamma",
        None,
        "override the smooth-step γ of the gates that declare one (DSelect-k; quick default or "
        "--full grid axis); part of every such run's hyperparameters",
    )
    grid_points: int = setting(20, "--full: grid points per cell", requires="full", type=POS)
    trials: int = setting(5, "--full: trials per grid point", requires="full", type=POS)
    telemetry: bool = False
    init: str = setting("keras", "initialisation (keras: TF2's)", choices=list(INITS))
    optimizer_defaults: str = setting(
        "tf",
        "optimizer constants (tf: TF2 Keras' Adagrad accumulator 0.1, eps 1e-7)",
        choices=list(OPTIMIZER_DEFAULTS),
    )
    dry_run: bool = setting(False, "print the plan (a timed probe of each gate), exit")

    @property
    def settings(self) -> tuple[Any, ...]:
        """The values of the experiment's ``setting_key`` (``(None,)`` when it has none)."""
        return (None,)


#: the loss of a trivial predictor: at most 26 on MovieLens (ln 2 for the binary task plus a
#: rating MSE of predicting 0, at most 5² = 25), 2 ln 10 = 4.6 on Multi-MNIST (uniform over 10
#: digits, two tasks)
TRIVIAL_LOSS = 26.0
#: metrics a finished run must have finite and at most their bound (over
#: :data:`~dselectk_research.records.EXPLOSION_FACTOR` times the trivial loss: exploded), else it
#: counts as diverged (the reports count such runs in every table and leave them out of the
#: means; the command exits 1)
FINITE = {"test_loss": EXPLOSION_FACTOR * TRIVIAL_LOSS, "val_loss": EXPLOSION_FACTOR * TRIVIAL_LOSS}


def data_key(exp: Experiment, config: Any) -> tuple[Any, ...]:
    return tuple(getattr(config, f) for f in exp.data_fields)


def init_seed(seed: int, gate: str, setting: Any, rep: int, phase: str = "final") -> int:
    """Initialisation seed of one run (stable, independent of sweep order): the text key's
    integer, not :func:`~dselectk_research.seeds.derive_seed` (see :mod:`dselectk_research.seeds`
    for why)."""
    key = f"{seed}|{gate}|{json.dumps(setting)}|{rep}|{phase}"
    return int.from_bytes(key.encode(), "little") % 2_147_483_647


def cell_key(setting_key: str | None, gate: str, setting: Any) -> str:
    """``gate[/setting_key=setting]``: a cell's key in ``selected_hparams.json`` and reports."""
    return gate if setting_key is None else f"{gate}/{setting_key}={setting}"


def record_config(
    exp: Experiment,
    gate: str,
    setting: Any,
    hp: Mapping[str, Any],
    rep: int,
    seed: int,
    base_seed: int,
    data_cfg: Mapping[str, Any],
    phase: str,
) -> dict[str, Any]:
    """The resolved config of one run (its record's identity)."""
    cfg: dict[str, Any] = {
        "experiment": exp.name,
        "phase": phase,
        "gate": gate,
        "hparams": dict(sorted(hp.items())),
        "rep": rep,
        "init_seed": seed,
        "seed": base_seed,
        "optimizer": exp.optimizer,
        "optimizer_defaults": exp.optimizer_defaults,
        "init": exp.init,
        "batch_size": exp.batch_size,
        "data": dict(data_cfg),
    }
    if exp.setting_key is not None:
        cfg[exp.setting_key] = setting
    return cfg
