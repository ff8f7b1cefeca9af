"""``dselectk reproduce synthetic``: the 128-task expert-selection study of Appendix C.1.

The package is laid out by concern: ``spec`` (the variants, the paper's grid and claims, record
identity), ``model`` (the vectorized model and its evaluation), ``loss`` (the fused CPU loss),
``train`` (training by the library's loop, grid search), ``recipe`` (flags and one cell of the
sweep, run by the shared runner) and ``report``. The data generator is a dataset:
:mod:`dselectk.data.synthetic`; the choices where the paper is silent are written into every
report (``templates/synthetic.md``).

Model (Appendix C.1, "Experiment Design"): multi-gate MoE with E = T/4 trainable experts of the
generator's form (``--experts``) and one static gate per task choosing k = 4 (``--k``); squared
error, Adam, batch 256, task losses **summed** (as Keras sums a multi-output model's losses, so
λ does not scale with T).

Speed: R repetitions are trained as one vectorized model: R·E stacked experts (one batched
matmul), a bank of R·T static gates and one (R, T, B) MSE. Each repetition only mixes its own E
experts, has its own initialisation (``variants.stack_members``: its parameters are those a
one-at-a-time model built under ``torch.manual_seed(init_seed_r)`` would have), and all
repetitions of a batch **see the same mini-batches**. Adam is elementwise, so the batched model
follows the same trajectory as R separate runs (tested against the one-at-a-time reference
path in ``benchmarks/synthetic_reference.py``).
"""

from dselectk.data.synthetic import SyntheticData, generate_data
from dselectk.experiments.synthetic.loss import mixture_loss
from dselectk.experiments.synthetic.model import SyntheticMoE, evaluate_model
from dselectk.experiments.synthetic.recipe import add_arguments, run
from dselectk.experiments.synthetic.report import print_table, write_report
from dselectk.experiments.synthetic.spec import (
    ALL_GATES,
    BASE_HPARAMS,
    BATCH_SIZE,
    DEFAULT_GATES,
    PAPER,
    VARIANTS,
    load_tuned,
    paper_grid,
    resolve_hparams,
)
from dselectk.experiments.synthetic.train import train_reps, tune

__all__ = [
    "ALL_GATES",
    "BASE_HPARAMS",
    "BATCH_SIZE",
    "DEFAULT_GATES",
    "PAPER",
    "VARIANTS",
    "SyntheticData",
    "SyntheticMoE",
    "add_arguments",
    "evaluate_model",
    "generate_data",
    "load_tuned",
    "mixture_loss",
    "paper_grid",
    "print_table",
    "resolve_hparams",
    "run",
    "train_reps",
    "tune",
    "write_report",
]
