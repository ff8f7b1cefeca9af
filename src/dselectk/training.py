"""A plain, reusable multi-task training loop.

Per-task losses are combined as a weighted **sum** Σ_t w_t ℓ_t, as in the reference Keras setup
(Keras sums the losses of a multi-output model). A mean over tasks would silently scale every
gate's regulariser λ by T relative to the data loss; with the sum, λ means the same thing
whatever the number of tasks. Auxiliary losses returned by the model (entropy terms, penalties,
balancing) are added unscaled.

The loop is the package's only one: the experiments drive it with their own batch loss
(``loss_fn``), their own optimizer (e.g. :class:`~dselectk.optim.RowwiseAdam` for vectorized
models) and callbacks that see every batch (``on_step``) and every epoch (``on_epoch``).

Distributed data parallel: wrap the model in ``torch.nn.parallel.DistributedDataParallel`` and
call :func:`train` in every process (e.g. under ``torchrun``). When a process group is
initialised, every epoch's shuffled order is the same on all ranks and each rank trains on its own
equal-sized shard, so ``batch_size`` is per process and DDP averages the gradients of a global
batch of ``world_size * batch_size``. Only rank 0 shows a progress bar.

Nothing goes silently wrong: a non-finite loss, gradient or parameter stops training with a
:class:`TrainingDivergedError` naming the step, the epoch, the task and the cause (or is skipped or
trained through, see ``TrainConfig.nonfinite``); the targets of the named losses are checked at the
first step; a checkpoint carries its run's configuration, and resuming it with another one is a
:class:`CheckpointMismatchError` (see ``TrainConfig.checkpoint``). The guards live in
:mod:`dselectk._train_checks`.
"""

from __future__ import annotations

import copy
import math
import random
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dselectk._train_checks import (
    CheckpointMismatchError,
    TrainingDivergedError,
    _all_finite,
    _check_config,
    _check_resumable,
    _check_targets,
    _checkpoint_state,
    _dist_rank_world,
    _diverged,
    _first_bad_rank,
    _gradients_diverged,
    _parameters_diverged,
    _restore_state,
    _run_config,
    _task_losses,
    data_digest,
)
from dselectk.gates.base import Gate, check_positive_int
from dselectk.io import save_torch
from dselectk.progress import tqdm
from dselectk.tasks import (
    LOSSES,
    LossFn,
    TaskData,
    _loss_names,
    evaluate,
)

__all__ = [
    "LOSSES",
    "BatchLossFn",
    "Callback",
    "CheckpointMismatchError",
    "GateRecorder",
    "History",
    "TaskData",
    "TrainConfig",
    "TrainingDivergedError",
    "evaluate",
    "make_optimizer",
    "seed_everything",
    "train",
]

#: ``loss_fn(model, batch) -> (total loss, model output or None)``: replaces the summed task losses
BatchLossFn = Callable[[nn.Module, "TaskData"], tuple[Tensor, Any]]


@dataclass
class TrainConfig:
    """Settings of :func:`train`.

    Attributes:
        optimizer: "adam", "adagrad" or "sgd".
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
            ``progress``, ``desc``, ``position``, ``nonfinite``, ``resume`` or the path).
            Resuming with any of these different raises :class:`CheckpointMismatchError`
            listing them. ``epochs`` may be *increased*: training continues from the
            checkpoint up to the new count (a run that stopped early stays stopped); fewer
            epochs than the checkpoint's run is a mismatch.
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
        NaN metrics while the others train on (``nonfinite="warn"``)."""
        return cls(
            lr=lr,
            batch_size=batch_size,
            epochs=epochs,
            seed=None,
            shuffle_seed=int(shuffle_seed),
            progress=progress,
            progress_unit="epoch",
            nonfinite="warn",
            desc=desc,
            position=position,
        )

    def __post_init__(self) -> None:
        _check_config(self)


@dataclass
class History:
    """What :func:`train` measured."""

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


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 - seeds code that uses the global NumPy RNG
    torch.manual_seed(seed)


def make_optimizer(
    name: str, params: Any, lr: float, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """Adam, Adagrad or SGD (``foreach`` implementations, fused where torch offers it)."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, foreach=True)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, foreach=True)
    raise ValueError(f"optimizer must be adam, adagrad or sgd, got {name!r}")


class Callback:
    """Hooks of :func:`train`; override what you need (all default to doing nothing).

    A plain callable ``f(model, history)`` passed as a callback is called after every step,
    like :meth:`on_step` (the batch and output are not passed to it).
    """

    def on_step(self, model: nn.Module, batch: TaskData, out: Any, history: History) -> None:
        """After every optimizer step and scheduler step: the batch and the model's output
        (``None`` when ``loss_fn`` returned none)."""

    def on_epoch(self, model: nn.Module, epoch: int, history: History) -> None:
        """After every epoch (1-based ``epoch``), after validation, before the checkpoint."""

    def on_train_end(self, model: nn.Module, history: History) -> None:
        """Once when training ends, normally or by an exception (release files, writers)."""


class GateRecorder(Callback):
    """Records the gate weights on a fixed ``probe`` batch every ``every`` steps into
    :attr:`History.recorded_steps` and :attr:`History.recorded_weights` (kept by checkpoints).
    The probe goes through the model as it is: in training mode, dropout draws from the RNG."""

    def __init__(self, probe: Tensor, every: int) -> None:
        check_positive_int("every", every)
        self.probe = probe
        self.every = every

    def on_step(self, model: nn.Module, batch: TaskData, out: Any, history: History) -> None:
        """Record the gate weights of the probe when ``history.steps`` is a multiple of every."""
        if history.steps % self.every:
            return
        with torch.no_grad():
            out = model(self.probe)
        w = getattr(out, "gate_weights", None)
        if w is None:
            w = getattr(out, "weights", None)
        if w is None:
            return
        w = w.detach()
        static = all(m.static for m in model.modules() if isinstance(m, Gate))
        if w.dim() == 3 or (w.dim() == 2 and w.shape[0] == self.probe.shape[0] and not static):
            w = w.mean(dim=0)  # per-example weights: the mean over the probe
        history.recorded_steps.append(history.steps)
        history.recorded_weights.append(w.cpu().clone())


def _step_hooks(callbacks: Sequence[Any]) -> list[Callable[..., None]]:
    hooks: list[Callable[..., None]] = []
    for cb in callbacks:
        if isinstance(cb, Callback):
            hooks.append(cb.on_step)
        elif callable(cb):
            hooks.append(lambda model, batch, out, hist, f=cb: f(model, hist))
        else:
            raise TypeError(f"callbacks must be Callback objects or callables, got {cb!r}")
    return hooks


def train(
    model: nn.Module,
    train_data: TaskData,
    losses: str | LossFn | Sequence[str | LossFn] | None,
    config: TrainConfig | None = None,
    *,
    val_data: TaskData | None = None,
    schedulers: Sequence[Any] = (),
    optimizer: torch.optim.Optimizer | None = None,
    callbacks: Sequence[Callback | Callable[[nn.Module, History], None]] = (),
    loss_fn: BatchLossFn | None = None,
) -> History:
    """Train a multi-task model (any module returning a ``MultiTaskOutput``).

    Each step minimises Σ_t w_t ℓ_t(batch) + aux_loss (or ``loss_fn(model, batch)``), then
    steps every scheduler and calls every callback.

    Args:
        model: e.g. :class:`~dselectk.models.MultiGateMoE` or
            :class:`~dselectk.models.SharedBottom`.
        train_data: training inputs and targets.
        losses: one loss for all tasks or one per task (a name in :data:`LOSSES` or a callable
            ``(pred, target) -> scalar``, averaged over the batch); None with ``loss_fn``.
        config: the settings; default :class:`TrainConfig()`.
        val_data: evaluated after every epoch (needed for early stopping).
        schedulers: stepped after every optimizer step (anything with ``step()``; with a
            checkpoint, also ``state_dict``/``load_state_dict``).
        optimizer: overrides ``config.optimizer``/``lr``.
        callbacks: :class:`Callback` objects (``on_step`` after every step, after the
            schedulers; ``on_epoch`` after every epoch), or callables ``f(model, history)``
            called after every step, e.g. to track when the gates become binary.
        loss_fn: ``(model, batch) -> (loss, output)``, the whole training loss of a batch
            (task losses, weights and auxiliary losses included); replaces ``losses`` for
            training (a vectorized model's fused loss, say).

    Returns:
        The :class:`History`. With early stopping, the model ends with its best weights.
    """
    cfg = config or TrainConfig()
    if cfg.seed is not None:
        seed_everything(cfg.seed)
    run = _Run(model, train_data, losses, cfg, val_data, schedulers, optimizer, callbacks, loss_fn)
    start_epoch = run.resume()
    model.train()
    try:
        for epoch in range(start_epoch, cfg.epochs):
            if not run.epoch(epoch):
                break
    finally:
        run.end()
    return run.restore_best()


class _Run:
    """The state of one :func:`train` call; each method is one named step of it."""

    def __init__(
        self,
        model: nn.Module,
        data: TaskData,
        losses: str | LossFn | Sequence[str | LossFn] | None,
        cfg: TrainConfig,
        val_data: TaskData | None,
        schedulers: Sequence[Any],
        optimizer: torch.optim.Optimizer | None,
        callbacks: Sequence[Callback | Callable[[nn.Module, History], None]],
        loss_fn: BatchLossFn | None,
    ) -> None:
        """Check the arguments; set up the optimizer, the shuffling, the shards and the bar."""
        self.fns, self.weights = _task_losses(losses, loss_fn, val_data, cfg, len(data.ys))
        self.model, self.data, self.val_data, self.cfg = model, data, val_data, cfg
        self.losses, self.loss_fn, self.schedulers = losses, loss_fn, schedulers
        self.opt = optimizer or make_optimizer(
            cfg.optimizer, model.parameters(), cfg.lr, cfg.weight_decay
        )
        shuffle_seed = cfg.shuffle_seed if cfg.shuffle_seed is not None else cfg.seed
        self.gen = torch.Generator().manual_seed(shuffle_seed if shuffle_seed is not None else 0)
        self.callbacks = [cb for cb in callbacks if isinstance(cb, Callback)]
        self.step_hooks = _step_hooks(callbacks)
        self.hist = History()
        self.best, self.bad_epochs = math.inf, 0
        self.best_state: dict[str, Tensor] | None = None
        self.rank, self.world = _dist_rank_world()
        self.shard = len(data) // self.world  # equal shards: every rank runs the same steps
        if self.shard == 0:
            raise ValueError(
                f"train_data has {len(data)} examples, fewer than the {self.world} processes"
            )
        self.steps_per_epoch = math.ceil(self.shard / cfg.batch_size)
        self.per_step = cfg.progress_unit == "step"
        self.bar = tqdm(
            total=cfg.epochs * (self.steps_per_epoch if self.per_step else 1),
            disable=not cfg.progress or self.rank != 0,
            unit="step" if self.per_step else "ep",
            desc=cfg.desc or None,
            position=cfg.position,
            leave=cfg.position is None,
        )
        self.kinds = _loss_names(losses, len(self.fns)) if losses is not None else []
        self.check_targets = loss_fn is None and any(k is not None for k in self.kinds)
        self.params = [p for p in model.parameters() if p.requires_grad]
        n, world = len(data), self.world
        digests = None  # the data's content, checked on resume (hashed only with a checkpoint)
        if cfg.checkpoint is not None:
            digests = {"train_data": data_digest(data), "val_data": data_digest(val_data)}
        self.config = _run_config(
            cfg, model, self.opt, losses, loss_fn, schedulers, n, world, digests
        )
        self.warned = False

    def resume(self) -> int:
        """Restore the checkpoint, if there is one, after checking its configuration; the epoch
        to start from."""
        cfg = self.cfg
        if cfg.checkpoint is None or not Path(cfg.checkpoint).is_file():
            return 0
        try:
            state = torch.load(cfg.checkpoint, map_location="cpu", weights_only=False)
        except Exception as e:  # truncated, garbled or not a torch file
            raise CheckpointMismatchError(
                f"checkpoint {cfg.checkpoint} cannot be read ({type(e).__name__}: {e}); "
                "delete it to start over"
            ) from e
        if not isinstance(state, dict) or "epoch" not in state or "model" not in state:
            raise CheckpointMismatchError(
                f"checkpoint {cfg.checkpoint} is not a training checkpoint of dselectk.train "
                "(no epoch or model state); delete it or pass another path"
            )
        _check_resumable(cfg.checkpoint, state.get("config"), self.config, cfg.resume)
        _restore_state(self, state)
        start_epoch = cfg.epochs if self.hist.stopped_early else state["epoch"]
        self.bar.update(
            min(start_epoch, cfg.epochs) * (self.steps_per_epoch if self.per_step else 1)
        )
        return int(start_epoch)

    def epoch(self, epoch: int) -> bool:
        """Train 0-based ``epoch`` on this rank's shard, then guard the parameters, validate and
        save a checkpoint; False when early stopping ends the run."""
        perm, size = self.shard_order(), self.cfg.batch_size
        total, counted = 0.0, 0
        for i, start in enumerate(range(0, self.shard, size)):
            step_no = epoch * self.steps_per_epoch + i + 1
            value = self.step(step_no, epoch + 1, perm[start : start + size])
            if value is not None:
                total, counted = total + value, counted + 1
            if self.per_step:
                self.bar.update(1)
        self.guard_parameters(epoch + 1)
        self.hist.train_loss.append(total / counted if counted else math.nan)
        postfix = {"epoch": epoch + 1, "loss": f"{self.hist.train_loss[-1]:.4g}"}
        if self.val_data is not None:
            val_total = self.validate()
            postfix["val"] = f"{val_total:.4g}"
            if self.early_stop(epoch, val_total):
                return False
        for cb in self.callbacks:
            cb.on_epoch(self.model, epoch + 1, self.hist)
        if not self.per_step:
            self.bar.update(1)
        self.bar.set_postfix(postfix)
        if self.cfg.checkpoint is not None and self.rank == 0:
            save_torch(self.cfg.checkpoint, _checkpoint_state(self, epoch + 1))
        return True

    def shard_order(self) -> Tensor:
        """This epoch's shuffled order (the same on every rank), cut to this rank's shard."""
        perm = torch.randperm(len(self.data), generator=self.gen)
        if self.world > 1:
            perm = perm[: self.shard * self.world].view(self.shard, self.world)[:, self.rank]
        return perm

    def step(self, step_no: int, epoch: int, idx: Tensor) -> float | None:
        """One optimizer step on the examples ``idx``, guarded; the loss, or None if skipped."""
        batch = self.data.batch(idx)
        loss, value, out, error = self.loss(step_no, epoch, batch)
        self.opt.zero_grad(set_to_none=True)
        if error is None or self.cfg.nonfinite == "warn":
            loss.backward()
            if self.cfg.nonfinite == "skip":
                error = self.guard_gradients(step_no, epoch, value)
        if error is not None:
            self.count_nonfinite(error)
            if self.cfg.nonfinite == "skip":
                self.opt.zero_grad(set_to_none=True)
                return None
        self.opt.step()
        for sched in self.schedulers:
            sched.step()
        self.hist.steps += 1
        for hook in self.step_hooks:
            hook(self.model, batch, out, self.hist)
        return value

    def loss(
        self, step_no: int, epoch: int, batch: TaskData
    ) -> tuple[Tensor, float, Any, TrainingDivergedError | None]:
        """The batch's training loss, its value and the model's output, with the loss guard: the
        error of a non-finite loss (on any rank), raised unless ``nonfinite`` is skip or warn."""
        task_losses: list[Tensor] | None = None
        aux: Any = None
        if self.loss_fn is not None:
            loss, out = self.loss_fn(self.model, batch)
        else:
            out = self.model(batch.x)
            if len(out.outputs) != len(self.fns):
                raise ValueError(
                    f"model has {len(out.outputs)} task outputs but {len(self.fns)} losses"
                )
            if self.check_targets:
                _check_targets(self.kinds, out.outputs, self.data.ys)
                self.check_targets = False
            task_losses = [fn(p, y) for fn, p, y in zip(self.fns, out.outputs, batch.ys)]
            aux = out.aux_loss
            loss = sum(w * lt for w, lt in zip(self.weights, task_losses)) + aux
        value = float(loss.detach())  # the loop's one host sync per step
        bad = not math.isfinite(value)
        other = _first_bad_rank(bad, self.rank, loss.device) if self.world > 1 else None
        if not bad and other is None:
            return loss, value, out, None
        error = _diverged(
            step=step_no,
            epoch=epoch,
            model=self.model,
            batch=batch,
            value=value,
            task_losses=task_losses,
            weights=self.weights,
            aux=aux,
            other_rank=None if bad else other,
        )
        if self.cfg.nonfinite == "raise":
            raise error
        return loss, value, out, error

    def guard_gradients(self, step: int, epoch: int, value: float) -> TrainingDivergedError | None:
        """The error of non-finite gradients under a finite loss (checked in "skip" mode)."""
        if _all_finite([p.grad for p in self.params if p.grad is not None]):
            return None
        return _gradients_diverged(self.model, step, epoch, value)

    def count_nonfinite(self, error: TrainingDivergedError) -> None:
        """Count a non-finite step that is skipped or trained through; warn about the first."""
        self.hist.nonfinite_steps += 1
        if self.warned:
            return
        self.warned = True
        action = "skipping" if self.cfg.nonfinite == "skip" else "training on through"
        warnings.warn(
            f"{error}. nonfinite={self.cfg.nonfinite!r}: {action} such steps "
            f"(counted in History.nonfinite_steps)",
            RuntimeWarning,
            stacklevel=5,  # the caller of train: train -> epoch -> step -> count_nonfinite
        )

    def guard_parameters(self, epoch: int) -> None:
        """At the end of 1-based ``epoch``: non-finite parameters stop the run (but with "warn")."""
        if self.cfg.nonfinite != "warn" and not _all_finite([p.detach() for p in self.params]):
            raise _parameters_diverged(self.model, epoch, epoch * self.steps_per_epoch)

    def validate(self) -> float:
        """Evaluate the validation data, record its task losses; their weighted sum."""
        assert self.losses is not None and self.val_data is not None  # checked by _task_losses
        val = evaluate(self.model, self.val_data, self.losses)["loss"]
        self.hist.val_losses.append(val)
        return sum(w * v for w, v in zip(self.weights, val))

    def early_stop(self, epoch: int, val_total: float) -> bool:
        """Track the best validation loss (and weights); whether patience has run out."""
        if val_total < self.best:
            self.best, self.bad_epochs, self.hist.best_epoch = val_total, 0, epoch
            if self.cfg.early_stopping_patience is not None:
                self.best_state = copy.deepcopy(self.model.state_dict())
            return False
        self.bad_epochs += 1
        patience = self.cfg.early_stopping_patience
        if patience is not None and self.bad_epochs >= patience:
            self.hist.stopped_early = True
            return True
        return False

    def end(self) -> None:
        """Close the progress bar and tell the callbacks (also after an error)."""
        self.bar.close()
        for cb in self.callbacks:
            cb.on_train_end(self.model, self.hist)

    def restore_best(self) -> History:
        """After early stopping, load the best weights; the history."""
        if self.best_state is not None and self.hist.stopped_early:
            self.model.load_state_dict(self.best_state)
        return self.hist
