"""``dselectk reproduce recovery``: expert recovery with frozen experts (Appendix C.2.2).

A data-generating MoE of ``--true-experts`` ReLU experts (default 4) labels 20k Gaussian inputs;
the model holds ``--experts`` frozen experts (default 16), exact copies of the generating ones
at random positions and random others, and a trainable static gate choosing ``--k`` of them
(default: the true count) for one logistic unit. The paper reports that after tuning DSelect-k
recovered all 4 true experts and Top-k only 1 (Figures C.3, C.4). The setup and the choices
where the paper is silent are written into every report (``templates/recovery.md``).

``model``: variants, vectorized model and its training; ``recipe``: flags, run config, one
cell per variant; ``report``. The generated data is :mod:`dselectk_research.data.recovery`.
"""

from dselectk_research.data.recovery import RecoveryData
from dselectk_research.recovery.model import (
    BASE_HPARAMS,
    BATCH_SIZE,
    VARIANTS,
    RecoveryMoE,
    train_reps,
)
from dselectk_research.recovery.recipe import add_arguments, init_seed, run, tuned_hparams
from dselectk_research.recovery.report import write_report

__all__ = [
    "BASE_HPARAMS",
    "BATCH_SIZE",
    "VARIANTS",
    "RecoveryData",
    "RecoveryMoE",
    "add_arguments",
    "init_seed",
    "run",
    "train_reps",
    "tuned_hparams",
    "write_report",
]
