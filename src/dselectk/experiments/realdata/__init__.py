"""Shared code of the real-data experiments (Sections 4.1–4.2, Appendices C.3, C.4, D.1, D.2).

A recipe (:mod:`dselectk.experiments.movielens`, :mod:`dselectk.experiments.multi_mnist`)
describes its experiment as an :class:`Experiment` (data, models, losses, hyperparameters,
report tables); this package, which never imports the recipes, runs it:

* ``spec`` — the gates (:data:`VARIANTS`), :class:`Splits`, :class:`Experiment`, the run config
  :class:`RealDataConfig`, record identity;
* ``train`` — one run (:func:`train_one`, observed by :class:`dselectk.monitor.GateMonitor`) and
  the ``--full`` random grid search;
* ``recipe`` — the flags, one (setting, gate) cell and :func:`run_experiment`: the sweep settings
  × gates × repetitions on the shared runner (resumable: one record per finished run);
* ``plan`` — the cost printed by ``--dry-run`` and before ``--full``;
* ``report`` — ``summary.json``, ``report.md`` and the plots, from the records alone.
"""

from dselectk.experiments.realdata.recipe import add_common_arguments, config_of, run_experiment
from dselectk.experiments.realdata.report import (
    diverged_label,
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
    RealDataConfig,
    Splits,
    TaskData,
)
from dselectk.experiments.realdata.train import train_one

__all__ = [
    "VARIANTS",
    "Experiment",
    "RealDataConfig",
    "Splits",
    "TaskData",
    "add_common_arguments",
    "config_of",
    "diverged_label",
    "fmt",
    "gate_rows",
    "paper_numbers",
    "run_experiment",
    "template_notes",
    "train_one",
    "training_note",
    "write_report",
]
