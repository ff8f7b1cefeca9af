"""``dselectk reproduce synthetic``: the 128-task expert-selection study of Appendix C.1.

A thin recipe over the library: the data is :mod:`dselectk_research.data.synthetic`, the model a
:class:`~dselectk.models.MoEBank` (R repetitions, or grid-search configurations, as one
vectorized model with a fused CPU loss), trained by :func:`dselectk.training.train`; the
report's prose, with the choices where the paper is silent, is ``templates/synthetic.md``.

Model (Appendix C.1, "Experiment Design"): multi-gate MoE with E = T/4 trainable experts of the
generator's form (``--experts``) and one static gate per task choosing k = 4 (``--k``); squared
error, Adam, batch 256, task losses **summed** (as Keras sums a multi-output model's losses, so
λ does not scale with T). All repetitions of a batch see the same mini-batches; each has its own
initialisation, and the batched model follows the same trajectory as R separate runs (tested
against the one-at-a-time reference path in ``benchmarks/synthetic_reference.py``).
"""

from dselectk_research.data.synthetic import SyntheticData, generate_data
from dselectk_research.synthetic.recipe import add_arguments, run
from dselectk_research.synthetic.report import write_report
from dselectk_research.synthetic.spec import (
    BASE_HPARAMS,
    BATCH_SIZE,
    DEFAULT_GATES,
    VARIANTS,
    K,
    load_tuned,
    paper_grid,
    resolve_hparams,
)
from dselectk_research.synthetic.train import build_model, train_reps, tune

__all__ = [
    "BASE_HPARAMS",
    "BATCH_SIZE",
    "DEFAULT_GATES",
    "VARIANTS",
    "K",
    "SyntheticData",
    "add_arguments",
    "build_model",
    "generate_data",
    "load_tuned",
    "paper_grid",
    "resolve_hparams",
    "run",
    "train_reps",
    "tune",
    "write_report",
]
