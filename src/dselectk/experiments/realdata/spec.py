"""What a real-data experiment is: its gates, its data splits and its :class:`Experiment` spec.

A recipe (:mod:`dselectk.experiments.movielens`, :mod:`dselectk.experiments.multi_mnist`) fills
an :class:`Experiment`: how to load the data, build a model for a gate, which losses, optimizer
and hyperparameters apply, and how its report is written. The shared code of this package
(training, tuning, the sweep, the report tables) only sees the spec, never the recipes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from dselectk.training import TaskData

__all__ = [
    "DEFAULT_GATES",
    "GATE_KINDS",
    "LABELS",
    "Experiment",
    "RealDataConfig",
    "Splits",
    "TaskData",
    "cell_key",
    "init_seed",
    "record_config",
]

#: experiment gate name → (registry gate name or "shared_bottom", per-example?)
GATE_KINDS: dict[str, tuple[str, bool]] = {
    "dselect_k_static": ("dselect_k", False),
    "topk_static": ("topk", False),
    "gumbel_softmax": ("gumbel_softmax", False),
    "dselect_k_per_example": ("dselect_k", True),
    "topk_per_example": ("topk", True),
    "softmax": ("softmax", False),
    "shared_bottom": ("shared_bottom", False),
}
LABELS: dict[str, str] = {
    "dselect_k_static": "Static DSelect-k",
    "topk_static": "Static Top-k",
    "gumbel_softmax": "Static Gumbel Softmax",
    "dselect_k_per_example": "Per-example DSelect-k",
    "topk_per_example": "Per-example Top-k",
    "softmax": "Softmax MoE",
    "shared_bottom": "Shared Bottom",
}
DEFAULT_GATES = list(GATE_KINDS)


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


@dataclass
class Experiment:
    """How one real-data experiment is run and reported.

    Every callable is a module-level function (the spec is sent to the sweep's worker
    processes).

    Attributes:
        name: CLI name, also ``config["experiment"]`` of every record ("movielens",
            "multi-mnist", "multi-fashion").
        setting_key: name of the per-setting config key (e.g. "alpha"), or None.
        losses: the per-task losses given to :func:`~dselectk.training.train`.
        task_names: labels of the tasks.
        optimizer: "adagrad" / "adam".
        batch_size: examples per step.
        quick_hparams: gate → hyperparameters of the quick default.
        grid: gate → {hyperparameter: values} of the ``--full`` random grid search.
        select: "min_loss" (weighted validation loss) or "max_accuracy" (mean validation
            accuracy), the tuning metric.
        build_model: (gate, hparams, meta) → model returning a ``MultiTaskOutput``.
        task_weights: setting value → task weights of the summed loss.
        expert_flops: (hparams, meta) → forward FLOPs of one expert on one example.
        load_data: parsed flags → :class:`Splits` (with ``config`` filled); called once per
            process of the sweep.
        data_key: parsed flags → key identifying the data ``load_data`` returns.
        notes: (parsed flags, data) → lines of the report's "Setup and choices" (data
            choices, reductions; saved in ``run_info.json``).
        write_report: results folder → None; rebuilds ``summary.json``, ``report.md`` and the
            plots from the records (the recipe's report, see :mod:`.report`).
        quick_reps: repetitions of the quick default.
        quick_gates: the gates of the quick default (None: all).
        reference: (parsed flags, data, results folder) → None; computes (once per data
            fingerprint) and caches the non-neural reference predictors of the report, or None.
        init: "keras" (the reference's TF2/Keras initialisation,
            :func:`~dselectk.layers.init.keras_init_`) or "torch" (PyTorch's defaults).
        optimizer_defaults: "tf" (TF2 Keras' optimizer defaults, e.g. Adagrad's initial
            accumulator 0.1 and ε 1e-7) or "torch"; see
            :func:`~dselectk.optim.make_reference_optimizer`.
    """

    name: str
    setting_key: str | None
    losses: Sequence[Any]
    task_names: Sequence[str]
    optimizer: str
    batch_size: int
    quick_hparams: Mapping[str, Mapping[str, Any]]
    grid: Mapping[str, Mapping[str, Sequence[Any]]]
    select: str
    build_model: Callable[[str, Mapping[str, Any], Mapping[str, Any]], nn.Module]
    task_weights: Callable[[Any], list[float]]
    expert_flops: Callable[[Mapping[str, Any], Mapping[str, Any]], float]
    load_data: Callable[[argparse.Namespace], Splits]
    data_key: Callable[[argparse.Namespace], Hashable]
    notes: Callable[[argparse.Namespace, Splits], list[str]]
    write_report: Callable[[Path], None]
    quick_reps: int = 2
    quick_gates: Sequence[str] | None = None
    reference: Callable[[argparse.Namespace, Splits, Path], None] | None = None
    init: str = "keras"
    optimizer_defaults: str = "tf"


#: flags that choose where and how the cells run, not what they compute
_EXECUTION_FLAGS = {"executor", "jobs", "threads", "no_progress", "debug", "command", "func"}


@dataclass(frozen=True)
class RealDataConfig:
    """What a real-data command computes (its run config): the flags every real-data
    experiment shares, typed, and the experiment's own flags in ``options`` (read as
    attributes too: ``config.variant``).
    """

    out: Path
    gates: tuple[str, ...]
    data_dir: Path | None = None
    repetitions: int | None = None
    seed: int = 0
    full: bool = False
    epochs: int | None = None
    lr: float | None = None
    grid_points: int | None = None
    trials: int = 5
    telemetry: bool = False
    init: str | None = None
    optimizer_defaults: str | None = None
    dry_run: bool = False
    options: tuple[tuple[str, Any], ...] = ()

    def __getattr__(self, name: str) -> Any:
        for key, value in object.__getattribute__(self, "options"):
            if key == name:
                return value
        raise AttributeError(f"{type(self).__name__} has no setting {name!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RealDataConfig:
        """The run config of parsed (and resolved) flags."""
        import dataclasses

        common = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        options = []
        for key, value in sorted(vars(args).items()):
            if key in _EXECUTION_FLAGS or key.startswith("slurm_"):
                continue
            value = tuple(value) if isinstance(value, list) else value
            if key in common:
                kw[key] = value
            else:
                options.append((key, value))
        return cls(**kw, options=tuple(options))


def init_seed(seed: int, gate: str, setting: Any, rep: int, phase: str = "final") -> int:
    """Initialisation seed of one run (stable, independent of sweep order)."""
    key = f"{seed}|{gate}|{json.dumps(setting)}|{rep}|{phase}"
    return int.from_bytes(key.encode(), "little") % 2_147_483_647


def cell_key(exp: Experiment, gate: str, setting: Any) -> str:
    """Key of a (setting, gate) cell in ``selected_hparams.json``: ``gate[/key=setting]``."""
    return gate if exp.setting_key is None else f"{gate}/{exp.setting_key}={setting}"


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
