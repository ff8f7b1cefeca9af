"""The state of one :func:`~dselectk.training.train` call: the :class:`History` it returns and
the :class:`RunState` a checkpoint saves and restores (:mod:`dselectk.training.checkpoint`)
and the loop advances (:mod:`dselectk.training.loop`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["History", "RunState"]


@dataclass
class History:
    """What :func:`train` measured.

    Examples:
        >>> from dselectk.training import TaskData, TrainConfig, train
        >>> x = torch.randn(32, 4)
        >>> data = TaskData(x, [x.sum(1, keepdim=True)])  # 32 examples, one task
        >>> hist = train(nn.Linear(4, 1), data, "mse", TrainConfig(epochs=2, progress=False))
        >>> len(hist.train_loss), hist.steps, hist.stopped_early, hist.diverged
        (2, 2, False, False)
    """

    train_loss: list[float] = field(default_factory=list)
    """Mean total training loss (summed task losses + auxiliary) per epoch."""
    val_losses: list[list[float]] = field(default_factory=list)
    """Per-epoch validation loss of each task."""
    steps: int = 0
    best_epoch: int | None = None
    recorded_steps: list[int] = field(default_factory=list)
    """Steps at which a :class:`GateRecorder` recorded."""
    recorded_weights: list[Tensor] = field(default_factory=list)
    """Gate weights at ``recorded_steps`` (static gates; per-example: mean over the batch)."""
    stopped_early: bool = False
    nonfinite_steps: int = 0
    """Steps whose loss or gradients were non-finite (skipped with ``nonfinite="skip"``, taken
    with ``"warn"``; not counted in :attr:`steps` when skipped)."""
    first_loss: float | None = None
    """The run's first finite training loss: the scale of the divergence rule
    (:func:`~dselectk.training.loss_diverged`)."""
    exploded_steps: int = 0
    """Steps whose loss was finite but above ``TrainConfig.divergence_factor`` times
    ``max(|first_loss|, 1)`` (skipped or taken as :attr:`nonfinite_steps` are)."""
    nonfinite_val_epochs: int = 0
    """Epochs whose validation loss was non-finite (with ``nonfinite`` skip or warn)."""

    @property
    def diverged(self) -> bool:
        """Whether any step diverged (non-finite or exploded loss or gradients) or any
        validation loss was non-finite. A run that raised :class:`TrainingDivergedError`
        returns no history."""
        return bool(self.nonfinite_steps or self.exploded_steps or self.nonfinite_val_epochs)


@dataclass
class RunState:
    """Everything of a run that changes as it trains (what a checkpoint holds, with the run's
    configuration ``config``).

    Examples:
        A fresh state, before its first epoch (:func:`~dselectk.training.train` builds it):

        >>> model = nn.Linear(4, 1)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> state = RunState(model, opt, schedulers=[], generator=torch.Generator(), config={})
        >>> state.best, state.bad_epochs, state.history.steps, state.best_state
        (inf, 0, 0, None)
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedulers: Sequence[Any]
    generator: torch.Generator
    """The mini-batch order's random generator."""
    config: dict[str, Any]
    """What changes the trajectory (see :func:`~dselectk.training.checkpoint.run_config`)."""
    history: History = field(default_factory=History)
    best: float = math.inf
    """The lowest weighted validation loss so far."""
    bad_epochs: int = 0
    """Epochs since :attr:`best` last improved."""
    best_state: dict[str, Tensor] | None = None
    """The model's weights at :attr:`best` (kept with early stopping)."""
