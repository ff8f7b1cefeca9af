"""``dselectk reproduce recovery``: expert recovery with frozen experts (Appendix C.2.2).

Laid out as the other recipes: ``model`` (the study's constants, data, vectorized model and
its training by the library's loop), ``recipe`` (flags and one cell, run by the shared
runner) and ``report``.

Data (Appendix C.2.2, "Additional details on data generation and model"): a data-generating MoE
of 4 experts, each a ReLU dense layer of 4 units; their average is fed to one logistic unit, and
the label is the sign of its output. X has 20,000 N(0, 1) rows of 10 features (10k train, 10k
validation).

Model: 16 frozen experts, 4 of them exact copies of the generating experts at random positions
and 12 random ones; a trainable static gate chooses 4 of them; the mixture feeds one logistic
unit. Cross-entropy, Adam, batch 256, learning rate tuned over {1e-1, ..., 1e-5}. The paper
reports that after tuning DSelect-k recovered all 4 true experts and Top-k only 1 (Figures C.3,
C.4 plot the weights during training).

Choices where the paper is silent (written into every report):

* generator experts and the random experts have N(0, 1) weights and no biases; the generating
  logistic unit has N(0, 1) weights and a bias equal to minus the median of its pre-activation,
  so the classes are balanced (a sign with bias 0 can give very unbalanced labels);
* the model's logistic unit is trainable (only the experts are frozen) and freshly initialised;
* every repetition draws its own random experts, copy positions, gate and head initialisation
  (the data set is the same for all repetitions); repetitions are trained together as one
  vectorized model (a bank of R static gates) and all see the same mini-batches;
* the number of epochs (not given by the paper) and DSelect-k's γ and λ come from the shipped
  tuning record ``tuned_recovery.json``;
* "recovered" counts the true experts among the experts with a nonzero weight (at most the 4
  largest weights count, see :func:`~dselectk.experiments.metrics.recovered_experts`).
"""

from dselectk.experiments.recovery.model import (
    BASE_HPARAMS,
    GATES,
    LABELS,
    LRS,
    PAPER,
    RecoveryData,
    RecoveryMoE,
    expert_outputs,
    generate_data,
    train_reps,
)
from dselectk.experiments.recovery.recipe import add_arguments, load_tuned, run
from dselectk.experiments.recovery.report import print_table, write_report

__all__ = [
    "BASE_HPARAMS",
    "GATES",
    "LABELS",
    "LRS",
    "PAPER",
    "RecoveryData",
    "RecoveryMoE",
    "add_arguments",
    "expert_outputs",
    "generate_data",
    "load_tuned",
    "print_table",
    "run",
    "train_reps",
    "write_report",
]
