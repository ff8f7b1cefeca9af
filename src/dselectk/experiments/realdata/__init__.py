"""Shared code of the real-data experiments (Sections 4.1–4.2, Appendices C.3, C.4, D.1, D.2).

A recipe (:mod:`dselectk.experiments.movielens`, :mod:`dselectk.experiments.multi_mnist`)
describes its experiment as an :class:`Experiment`: how to load the data, build a model for a
gate, which losses, hyperparameters and report apply. This package runs it:

* ``spec`` — the gates, :class:`Splits`, :class:`Experiment`, record identity (configs, seeds);
* ``monitor`` — Table C.2's measurements during training (the :class:`GateMonitor` callback, FLOPs);
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

from dselectk.experiments.realdata.monitor import (
    GateMonitor,
    flops_ratio,
    gate_summary,
    training_expert_flops,
)
from dselectk.experiments.realdata.recipe import (
    add_common_arguments,
    build_recipe,
    config_of,
    load,
    run_cell,
    run_experiment,
)
from dselectk.experiments.realdata.report import (
    current_records,
    fmt,
    gate_rows,
    paper_numbers,
    table_c2,
    template_notes,
    training_note,
    write_report,
)
from dselectk.experiments.realdata.spec import (
    MODEL_HPARAMS,
    VARIANTS,
    Experiment,
    GateChoice,
    RealDataConfig,
    Splits,
    TaskData,
    cell_key,
    init_seed,
    label,
    record_config,
)
from dselectk.experiments.realdata.train import train_one, tune

__all__ = [
    "MODEL_HPARAMS",
    "VARIANTS",
    "Experiment",
    "GateChoice",
    "GateMonitor",
    "RealDataConfig",
    "Splits",
    "TaskData",
    "add_common_arguments",
    "build_recipe",
    "cell_key",
    "config_of",
    "current_records",
    "flops_ratio",
    "fmt",
    "gate_rows",
    "gate_summary",
    "init_seed",
    "label",
    "load",
    "paper_numbers",
    "record_config",
    "run_cell",
    "run_experiment",
    "table_c2",
    "template_notes",
    "train_one",
    "training_expert_flops",
    "training_note",
    "tune",
    "write_report",
]
