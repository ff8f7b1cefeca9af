"""The shared framework of the real-data experiments (Sections 4.1–4.2, Appendices C.3, C.4,
D.1, D.2). A recipe (:mod:`dselectk_research.movielens`,
:mod:`dselectk_research.multi_mnist`) describes its experiment as an :class:`Experiment`;
this package, which never imports the recipes, runs it: ``spec`` (the gates, the spec, the run
config and its flags, record identity), ``train`` (one run, the ``--full`` grid search),
``recipe`` (cells, the command on the shared runner), ``plan`` (the ``--dry-run`` cost) and
``report`` (summary, report and plots from the records alone).
"""

from dselectk_research.realdata.recipe import add_common_arguments, config_of, run_experiment
from dselectk_research.realdata.report import (
    diverged_label,
    fmt,
    gate_rows,
    paper_numbers,
    template_notes,
    write_report,
)
from dselectk_research.realdata.spec import (
    VARIANTS,
    Experiment,
    RealDataConfig,
    Splits,
    TaskData,
    per_gate,
)
from dselectk_research.realdata.train import train_one

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
    "per_gate",
    "run_experiment",
    "template_notes",
    "train_one",
    "write_report",
]
