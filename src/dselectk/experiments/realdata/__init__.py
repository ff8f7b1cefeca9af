"""Shared code of the real-data experiments (Sections 4.1–4.2, Appendices C.3, C.4, D.1, D.2).

A recipe (:mod:`dselectk.experiments.movielens`, :mod:`dselectk.experiments.multi_mnist`)
describes its experiment as an :class:`Experiment`: how to load the data, build a model for a
gate, which losses, hyperparameters and report apply. This package runs it:

* ``spec`` — the gates (:data:`VARIANTS`: typed variants, static or per-example),
  :class:`Splits`, :class:`Experiment`, the run config :class:`RealDataConfig`, record identity;
* ``train`` — one run (:func:`train_one`) and the ``--full`` random grid search (:func:`tune`);
* ``recipe`` — the flags, one (setting, gate) cell, and :func:`run_experiment`, which runs (or
  resumes) the sweep settings × gates × repetitions on the shared runner
  (:mod:`dselectk.experiments.runner`, ``--jobs`` worker processes);
* ``report`` — ``summary.json``, ``report.md`` and the PNG plots, rebuilt from the run records
  alone (:func:`write_report`, prose in ``templates/realdata.md``).

Every finished run is one JSON record (:class:`~dselectk.experiments.records.RunStore`), keyed
by the hash of its resolved config, written atomically: an interrupted sweep restarted with the
same command skips finished runs and never leaves partial records. This package never imports
the recipes: each recipe's :class:`Experiment` carries its own paper tables.
"""

from dselectk.experiments.realdata.recipe import (
    add_common_arguments,
    config_of,
    run_experiment,
)
from dselectk.experiments.realdata.report import (
    fmt,
    gate_rows,
    paper_numbers,
    template_notes,
    training_note,
    write_report,
)
from dselectk.experiments.realdata.spec import (
    VARIANTS,
    Experiment,
    GateChoice,
    RealDataConfig,
    Splits,
    TaskData,
    label,
)
from dselectk.experiments.realdata.train import train_one
from dselectk.monitor import GateMonitor, flops_ratio, training_expert_flops

__all__ = [
    "VARIANTS",
    "Experiment",
    "GateChoice",
    "GateMonitor",
    "RealDataConfig",
    "Splits",
    "TaskData",
    "add_common_arguments",
    "config_of",
    "flops_ratio",
    "fmt",
    "gate_rows",
    "label",
    "paper_numbers",
    "run_experiment",
    "template_notes",
    "train_one",
    "training_expert_flops",
    "training_note",
    "write_report",
]
