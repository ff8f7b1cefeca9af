"""The settings of :func:`~dselectk.training.train`: :class:`TrainConfig` (checked when it is
built; the optimizer it names is built by :func:`dselectk.optim.make_optimizer`) and the
seeding (:func:`seed_everything`)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from dselectk._validate import check_flag, check_number
from dselectk.gates.base import check_nonnegative, check_positive_int
from dselectk.optim import OPTIMIZERS
from dselectk.runtime import PARALLEL_MIN_WORK, policy_threads
from dselectk.training.guards import DIVERGENCE_FACTOR
from dselectk.training.search import SearchPlan

if TYPE_CHECKING:
    from dselectk.training.tasks import TaskData

__all__ = [
    "PARALLEL_MIN_WORK",
    "BatchLossFn",
    "TrainConfig",
    "seed_everything",
    "train_threads",
]


#: ``loss_fn(model, batch) -> (total loss, model output or None)``: replaces the summed task losses
BatchLossFn = Callable[[nn.Module, "TaskData"], tuple[Tensor, Any]]


@dataclass
class TrainConfig:
    """Settings of :func:`~dselectk.training.train`.

    Attributes:
        optimizer: "adam", "adagrad" or "sgd" with torch's constants
            (:func:`dselectk.optim.make_optimizer`; pass ``train(..., optimizer=...)`` for
            another, e.g. ``make_optimizer("adagrad", params, lr, defaults="tf")``).
        lr: learning rate.
        batch_size: examples per step.
        epochs: passes over the training data.
        task_weights: w_t of the summed loss; default all 1.
        seed: seeds Python, NumPy and torch (and the shuffling) when not None.
        shuffle_seed: seed of the mini-batch order (default: ``seed``, else 0). Set it with
            ``seed=None`` to shuffle reproducibly without touching the global RNGs (a
            vectorized model initialised by its own seeds).
        early_stopping_patience: stop after this many epochs without a lower validation loss
            and restore the best weights (None: no early stopping).
        progress: show a progress bar.
        progress_unit: "step" (one tick per optimizer step) or "epoch".
        desc: label of the progress bar.
        position: line of the progress bar (worker processes each take their own line).
        weight_decay: optimizer weight decay.
        checkpoint: file to save the full training state to after every epoch (atomically,
            with :func:`dselectk.io.save_torch`). If it exists when training starts, training
            resumes from it, with the model, optimizer, schedulers, shuffling and RNG states
            restored, so an interrupted run continues as if it had never stopped. The checkpoint
            carries the run's configuration: the optimizer (class and hyperparameters: lr,
            weight decay, betas, ...), ``batch_size``, ``seed``, ``shuffle_seed``,
            ``task_weights``, ``early_stopping_patience``, the losses (names,
            or the callables' qualified names) and ``loss_fn``, the schedulers' classes, the
            number of examples, the world size and the model's parameter names and shapes (not
            ``progress``, ``desc``, ``position``, ``nonfinite``, ``resume``,
            ``divergence_factor`` or the path).
            Resuming with any of these different raises :class:`CheckpointMismatchError`
            listing them. ``epochs`` may be *increased*: training continues from the
            checkpoint up to the new count (a run that stopped early stays stopped); fewer
            epochs than the checkpoint's run is a mismatch.
            A checkpoint whose model, best weights or optimizer state hold NaN/inf is refused
            with a :class:`~dselectk.training.CheckpointError` naming the file (unless
            ``nonfinite="warn"``, whose runs train on through diverged members).
        nonfinite: what a non-finite loss or gradient does. "raise" (default): stop with a
            :class:`TrainingDivergedError` naming the step, the epoch, the task and the cause;
            the model keeps the parameters of the last good step, unless the non-finite
            gradients of an earlier step already reached them. "skip": skip the step (no
            optimizer step, no scheduler step, no callbacks; the gradients are checked before
            every optimizer step, a fused max-norm and one more host sync per step), warn once
            and count it in :attr:`History.nonfinite_steps`; parameters that became non-finite
            anyway (an overflowing update) still raise at the end of the epoch. "warn": train on
            as before (warn once, count the steps), for models whose loss sums independent
            members (a vectorized grid search) where one diverged member must not stop the
            others; check the members' results yourself.
        resume: "strict" (default): a checkpoint written with another configuration is an
            error; "force": resume it anyway (with a warning listing the differences).
        divergence_factor: a finite loss above ``divergence_factor * max(|L0|, 1)``, L0 the
            run's first loss, counts as diverged like a non-finite one (see
            :func:`~dselectk.training.loss_diverged`): it raises, is skipped or is counted in
            :attr:`History.exploded_steps` as ``nonfinite`` says. Default
            :data:`~dselectk.training.DIVERGENCE_FACTOR` (1e6); None: only non-finite losses
            diverge.
        threads: torch's intra-op threads while training (restored afterwards). "auto"
            (default): the package's thread policy (:mod:`dselectk.runtime`, overridable with
            ``DSELECTK_THREADS`` or :func:`~dselectk.runtime.set_thread_policy`): one thread
            when a step's work, ``batch_size`` times the trainable parameters, is below
            :data:`~dselectk.runtime.PARALLEL_MIN_WORK`, else torch's current count capped to
            the CPUs the process may use (:func:`~dselectk.runtime.cpu_quota`): small steps
            gain nothing from a parallel region and, beside other busy processes, lose 4-40x
            waiting at its barrier for a descheduled thread. An int n >= 1: n threads; None:
            leave torch's setting alone.
        search: the swap local search (:mod:`dselectk.search`) that makes a static sparse gate
            end on k distinct experts: gradient descent cannot move a DSelect-k selector once
            its bits are binary, nor a Top-k gate's unselected experts, so a selection that
            settled on the wrong expert, or on one another selector holds, stays there.
            "auto" (default): for every searchable static gate (DSelect-k, Top-k with
            ``in_features=None``) of a :class:`~dselectk.models.MoE`,
            :class:`~dselectk.models.MultiGateMoE` or :class:`~dselectk.models.MoEBank` trained
            with ``losses``, run :func:`~dselectk.search.default_plan`: DSelect-k searches after
            25 %, 70 % and 85 % of the steps and is forced to a binary selection of k distinct
            experts at 50 %; Top-k searches at 25/50/70/85 %. Nothing runs for other models, for
            per-example gates, or with ``loss_fn``. Cost: each search scores every expert for
            every selector, one forward pass on a fixed probe of 2048 training examples per
            candidate, at most ``1 + 2·k·E`` passes per search (two sweeps), so at most
            ``4·(1 + 2·k·E)`` probe passes per run (k = 2, E = 8: 132), whatever the epochs.
            A :class:`~dselectk.search.SearchPlan`: that schedule instead. None: no search
            (the selection is what gradient descent leaves).

    Examples:
        >>> cfg = TrainConfig(optimizer="adagrad", lr=0.05, batch_size=128, epochs=3)
        >>> cfg.optimizer, cfg.weight_decay, cfg.search
        ('adagrad', 0.0, 'auto')
        >>> TrainConfig(lr=0.0)
        Traceback (most recent call last):
        ...
        ValueError: lr must be a finite number > 0, got 0.0
    """

    optimizer: str = "adam"
    lr: float = 1e-3
    batch_size: int = 256
    epochs: int = 10
    task_weights: Sequence[float] | None = None
    seed: int | None = 0
    shuffle_seed: int | None = None
    early_stopping_patience: int | None = None
    progress: bool = True
    progress_unit: str = "step"
    desc: str = ""
    position: int | None = None
    weight_decay: float = 0.0
    checkpoint: str | Path | None = None
    nonfinite: str = "raise"
    resume: str = "strict"
    divergence_factor: float | None = DIVERGENCE_FACTOR
    threads: int | str | None = "auto"
    search: SearchPlan | str | None = "auto"

    @classmethod
    def for_members(
        cls,
        *,
        lr: float,
        batch_size: int,
        epochs: int,
        shuffle_seed: int,
        progress: bool = False,
        desc: str = "",
        position: int | None = None,
    ) -> TrainConfig:
        """Settings for a vectorized model whose independent members (repetitions, grid
        points) train as one: no global seeding (each member was initialised by its own seed),
        one shared shuffle, one progress tick per epoch, and a member that diverges ends with
        NaN metrics while the others train on (``nonfinite="warn"``). No search of its own
        (``search=None``): such a model is trained with ``loss_fn`` and given its search as a
        callback (:meth:`~dselectk.search.SearchPlan.bank_callback`)."""
        return cls(
            lr=lr,
            batch_size=batch_size,
            epochs=epochs,
            seed=None,
            shuffle_seed=int(shuffle_seed),
            progress=progress,
            progress_unit="epoch",
            nonfinite="warn",
            search=None,
            desc=desc,
            position=position,
        )

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        check_number("lr", self.lr, minimum=0.0, open_min=True)
        check_flag("progress", self.progress)
        if self.progress_unit not in ("step", "epoch"):
            raise ValueError(f"progress_unit must be step or epoch, got {self.progress_unit!r}")
        check_positive_int("batch_size", self.batch_size)
        check_positive_int("epochs", self.epochs, 0)
        if self.early_stopping_patience is not None:
            check_positive_int("early_stopping_patience", self.early_stopping_patience)
        check_nonnegative("weight_decay", self.weight_decay)
        if self.nonfinite not in ("raise", "skip", "warn"):
            raise ValueError(f"nonfinite must be raise, skip or warn, got {self.nonfinite!r}")
        if self.resume not in ("strict", "force"):
            raise ValueError(f"resume must be strict or force, got {self.resume!r}")
        for name in ("seed", "shuffle_seed"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name), 0)
        if self.position is not None:
            check_positive_int("position", self.position, 0)
        if not isinstance(self.desc, str):
            raise TypeError(f"desc must be a str, got {type(self.desc).__name__}")
        if isinstance(self.task_weights, (str, bytes)):
            raise TypeError(f"task_weights must be a list of numbers, got {self.task_weights!r}")
        if self.task_weights is not None:
            for w in self.task_weights:
                check_nonnegative("task_weights[i]", w)
        if self.threads is not None and self.threads != "auto":
            check_positive_int("threads", self.threads)
        if not (
            self.search is None or self.search == "auto" or isinstance(self.search, SearchPlan)
        ):
            raise ValueError(
                f"search must be 'auto', a dselectk.search.SearchPlan or None, got {self.search!r}"
            )
        if self.divergence_factor is not None and not (
            isinstance(self.divergence_factor, (int, float))
            and not isinstance(self.divergence_factor, bool)
            and math.isfinite(self.divergence_factor)
            and self.divergence_factor > 1
        ):
            raise ValueError(
                f"divergence_factor must be a finite number > 1 or None, got "
                f"{self.divergence_factor!r}"
            )


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch.

    Examples:
        >>> seed_everything(7)
        >>> a = torch.rand(2)
        >>> seed_everything(7)
        >>> torch.equal(a, torch.rand(2))
        True
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 - seeds code that uses the global NumPy RNG
    torch.manual_seed(seed)


def train_threads(cfg: TrainConfig, model: nn.Module) -> int | None:
    """The intra-op thread count :func:`~dselectk.training.train` sets for ``cfg.threads``
    (None: torch's setting stays).

    Examples:
        >>> small = nn.Linear(8, 2)  # 18 parameters x 256 examples: below PARALLEL_MIN_WORK
        >>> train_threads(TrainConfig(), small), train_threads(TrainConfig(threads=3), small)
        (1, 3)
        >>> train_threads(TrainConfig(threads=None), small) is None
        True
    """
    if cfg.threads is None:
        return None
    if cfg.threads != "auto":
        return int(cfg.threads)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return policy_threads(cfg.batch_size * params)
