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

Nothing goes silently wrong:

* **Divergence guard.** A non-finite loss (or gradient) stops training with a
  :class:`TrainingDivergedError` (a ``FloatingPointError``) naming the step, the epoch and the task
  whose loss went non-finite, and what in the batch or the model caused it, e.g. ``training diverged
  at step 12 (epoch 1): the loss of task 1 (ys[1]) is nan; the targets ys[1] of this batch hold
  NaN/inf``. ``TrainConfig(nonfinite="skip")`` skips such steps instead, ``"warn"`` trains on
  (see :class:`TrainConfig`). The loss check reuses the loss value the loop reads every step anyway
  (no extra host sync); gradients are checked every step only in ``"skip"`` mode, otherwise when a
  loss goes non-finite (the previous step's gradients and the parameters are inspected to name the
  cause) and, with the parameters, once at the end of every epoch.
* **Targets are checked** once, at the first step, against the model's outputs for the named
  losses ("mse", "bce", "ce"): shapes, class indices and value ranges, with a ``ValueError`` naming
  the task and what was expected.
* **Checkpoints carry their configuration** (everything that changes the trajectory and the
  model's parameter shapes); resuming with another one is a :class:`CheckpointMismatchError`
  listing the differing fields unless ``TrainConfig(resume="force")``.
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
    _check_targets,
    _config_diff,
    _diverged,
    _first_bad_rank,
    _nonfinite_names,
    _run_config,
)
from dselectk.gates.base import check_nonnegative, check_positive_int
from dselectk.io import save_torch
from dselectk.progress import tqdm
from dselectk.tasks import (
    LOSSES,
    LossFn,
    TaskData,
    _loss_names,
    _resolve_losses,
    evaluate,
)

__all__ = [
    "LOSSES",
    "BatchLossFn",
    "Callback",
    "CheckpointMismatchError",
    "History",
    "TaskData",
    "TrainConfig",
    "TrainingDivergedError",
    "evaluate",
    "make_optimizer",
    "optimizer_step",
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
        record_every: record the gate weights every N steps (0: never).
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
            ``task_weights``, ``early_stopping_patience``, ``record_every``, the losses (names,
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
    record_every: int = 0
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
        if self.optimizer not in ("adam", "adagrad", "sgd"):
            raise ValueError(f"optimizer must be adam, adagrad or sgd, got {self.optimizer!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if self.progress_unit not in ("step", "epoch"):
            raise ValueError(f"progress_unit must be step or epoch, got {self.progress_unit!r}")
        check_positive_int("batch_size", self.batch_size)
        check_positive_int("epochs", self.epochs, 0)
        check_positive_int("record_every", self.record_every, 0)
        if self.early_stopping_patience is not None:
            check_positive_int("early_stopping_patience", self.early_stopping_patience)
        check_nonnegative("weight_decay", self.weight_decay)
        if self.nonfinite not in ("raise", "skip", "warn"):
            raise ValueError(f"nonfinite must be raise, skip or warn, got {self.nonfinite!r}")
        if self.resume not in ("strict", "force"):
            raise ValueError(f"resume must be strict or force, got {self.resume!r}")
        if self.task_weights is not None:
            for w in self.task_weights:
                check_nonnegative("task_weights[i]", w)


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


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _gate_snapshot(model: nn.Module, x: Tensor) -> Tensor | None:
    out = model(x)
    w = getattr(out, "gate_weights", None)
    if w is None:
        w = getattr(out, "weights", None)
    if w is None:
        return None
    w = w.detach()
    if w.dim() == 3 or (w.dim() == 2 and w.shape[0] == x.shape[0] and not _is_static(model)):
        w = w.mean(dim=0)
    return w.cpu().clone()


def _is_static(model: nn.Module) -> bool:
    from dselectk.gates.base import Gate

    return all(m.static for m in model.modules() if isinstance(m, Gate))


def optimizer_step(
    optimizer: torch.optim.Optimizer, loss: Tensor, schedulers: Sequence[Any] = ()
) -> None:
    """The body of one training step: gradients of ``loss``, the optimizer step, then every
    scheduler's step."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    for s in schedulers:
        s.step()


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
    if losses is None and (loss_fn is None or val_data is not None):
        raise ValueError("losses is needed unless loss_fn is given and there is no val_data")
    fns = _resolve_losses(losses, len(train_data.ys)) if losses is not None else []
    weights = list(cfg.task_weights) if cfg.task_weights is not None else [1.0] * len(fns)
    if fns and len(weights) != len(fns):
        raise ValueError(
            f"task_weights must have one weight per task ({len(fns)}), got {len(weights)}"
        )
    if cfg.early_stopping_patience is not None and val_data is None:
        raise ValueError("early_stopping_patience needs val_data")
    opt = optimizer or make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.weight_decay)
    shuffle_seed = cfg.shuffle_seed if cfg.shuffle_seed is not None else cfg.seed
    gen = torch.Generator().manual_seed(shuffle_seed if shuffle_seed is not None else 0)
    step_hooks = _step_hooks(callbacks)
    epoch_hooks = [cb.on_epoch for cb in callbacks if isinstance(cb, Callback)]
    hist = History()
    best = math.inf
    best_state: dict[str, Tensor] | None = None
    bad_epochs = 0
    rank, world = _dist_rank_world()
    n = len(train_data)
    shard = n // world  # equal shards: every rank runs the same number of steps
    if shard == 0:
        raise ValueError(f"train_data has {n} examples, fewer than the {world} processes")
    steps_per_epoch = math.ceil(shard / cfg.batch_size)
    per_step = cfg.progress_unit == "step"
    bar = tqdm(
        total=cfg.epochs * (steps_per_epoch if per_step else 1),
        disable=not cfg.progress or rank != 0,
        unit="step" if per_step else "ep",
        desc=cfg.desc or None,
        position=cfg.position,
        leave=cfg.position is None,
    )
    probe = train_data.x[: min(n, 1024)]
    kinds = _loss_names(losses, len(fns)) if losses is not None else []
    check_targets = loss_fn is None and any(k is not None for k in kinds)
    params = [p for p in model.parameters() if p.requires_grad]
    run_config = _run_config(cfg, model, opt, losses, loss_fn, schedulers, n, world)
    start_epoch = 0
    if cfg.checkpoint is not None and Path(cfg.checkpoint).is_file():
        state = torch.load(cfg.checkpoint, map_location="cpu", weights_only=False)
        saved = state.get("config")
        if saved is None:
            diffs = ["the checkpoint carries no configuration (written by an older dselectk)"]
        else:
            diffs = _config_diff(saved, run_config)
        if diffs:
            listing = "; ".join(diffs)
            if cfg.resume != "force":
                raise CheckpointMismatchError(
                    f"checkpoint {cfg.checkpoint} was written by a run with another "
                    f"configuration: {listing}. Delete it to start over, or pass "
                    f"TrainConfig(resume='force') to resume it anyway"
                )
            warnings.warn(
                f"resuming checkpoint {cfg.checkpoint} despite another configuration "
                f"(resume='force'): {listing}",
                RuntimeWarning,
                stacklevel=2,
            )
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        for s, st in zip(schedulers, state["schedulers"]):
            s.load_state_dict(st)
        gen.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        hist, best, bad_epochs, best_state = (
            state["history"],
            state["best"],
            state["bad_epochs"],
            state["best_state"],
        )
        start_epoch = cfg.epochs if hist.stopped_early else state["epoch"]
        bar.update(min(start_epoch, cfg.epochs) * (steps_per_epoch if per_step else 1))
    warned = False
    model.train()
    try:
        for epoch in range(start_epoch, cfg.epochs):
            perm = torch.randperm(n, generator=gen)  # the same order on every rank
            if world > 1:
                perm = perm[: shard * world].view(shard, world)[:, rank]
            total = 0.0
            counted = 0
            for i, start in enumerate(range(0, shard, cfg.batch_size)):
                batch = train_data.batch(perm[start : start + cfg.batch_size])
                task_losses: list[Tensor] | None = None
                aux: Any = None
                if loss_fn is None:
                    out = model(batch.x)
                    if len(out.outputs) != len(fns):
                        raise ValueError(
                            f"model has {len(out.outputs)} task outputs but {len(fns)} losses"
                        )
                    if check_targets:
                        _check_targets(kinds, out.outputs, train_data.ys)
                        check_targets = False
                    task_losses = [fn(p, y) for fn, p, y in zip(fns, out.outputs, batch.ys)]
                    aux = out.aux_loss
                    loss = sum(w * lt for w, lt in zip(weights, task_losses)) + aux
                else:
                    loss, out = loss_fn(model, batch)
                value = float(loss.detach())  # the loop's one host sync per step
                bad = not math.isfinite(value)
                other = _first_bad_rank(bad, rank, loss.device) if world > 1 else None
                step_no = epoch * steps_per_epoch + i + 1
                error: TrainingDivergedError | None = None
                if bad or other is not None:
                    error = _diverged(
                        step=step_no,
                        epoch=epoch + 1,
                        model=model,
                        batch=batch,
                        value=value,
                        task_losses=task_losses,
                        weights=weights,
                        aux=aux,
                        other_rank=None if bad else other,
                    )
                    if cfg.nonfinite == "raise":
                        raise error
                opt.zero_grad(set_to_none=True)
                if error is None or cfg.nonfinite == "warn":
                    loss.backward()
                    if cfg.nonfinite == "skip" and not _all_finite(
                        [p.grad for p in params if p.grad is not None]
                    ):
                        names = _nonfinite_names([(n, p.grad) for n, p in model.named_parameters()])
                        error = TrainingDivergedError(
                            f"training diverged at step {step_no} (epoch {epoch + 1}): the loss "
                            f"is finite ({value:.6g}) but the gradients of {names} are not; "
                            f"lower the learning rate",
                            step=step_no,
                            epoch=epoch + 1,
                        )
                if error is not None:
                    hist.nonfinite_steps += 1
                    if not warned:
                        warned = True
                        action = "skipping" if cfg.nonfinite == "skip" else "training on through"
                        warnings.warn(
                            f"{error}. nonfinite={cfg.nonfinite!r}: {action} such steps "
                            f"(counted in History.nonfinite_steps)",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                    if cfg.nonfinite == "skip":
                        opt.zero_grad(set_to_none=True)
                        if per_step:
                            bar.update(1)
                        continue
                opt.step()
                for sched in schedulers:
                    sched.step()
                hist.steps += 1
                for hook in step_hooks:
                    hook(model, batch, out, hist)
                total += value
                counted += 1
                if cfg.record_every and hist.steps % cfg.record_every == 0:
                    with torch.no_grad():
                        snap = _gate_snapshot(model, probe)
                    if snap is not None:
                        hist.recorded_steps.append(hist.steps)
                        hist.recorded_weights.append(snap)
                if per_step:
                    bar.update(1)
            if cfg.nonfinite != "warn" and not _all_finite([p.detach() for p in params]):
                names = _nonfinite_names([(n, p.detach()) for n, p in model.named_parameters()])
                raise TrainingDivergedError(
                    f"training diverged in epoch {epoch + 1} (by step "
                    f"{(epoch + 1) * steps_per_epoch}): the parameters {names} are non-finite "
                    f"although every loss was finite (non-finite gradients or an overflowing "
                    f"update); lower the learning rate",
                    step=(epoch + 1) * steps_per_epoch,
                    epoch=epoch + 1,
                )
            hist.train_loss.append(total / counted if counted else math.nan)
            postfix = {"epoch": epoch + 1, "loss": f"{hist.train_loss[-1]:.4g}"}
            if val_data is not None:
                assert losses is not None  # checked above
                val = evaluate(model, val_data, losses)["loss"]
                hist.val_losses.append(val)
                val_total = sum(w * v for w, v in zip(weights, val))
                postfix["val"] = f"{val_total:.4g}"
                if val_total < best:
                    best, bad_epochs, hist.best_epoch = val_total, 0, epoch
                    if cfg.early_stopping_patience is not None:
                        best_state = copy.deepcopy(model.state_dict())
                else:
                    bad_epochs += 1
                    patience = cfg.early_stopping_patience
                    if patience is not None and bad_epochs >= patience:
                        hist.stopped_early = True
                        break
            for epoch_hook in epoch_hooks:
                epoch_hook(model, epoch + 1, hist)
            if not per_step:
                bar.update(1)
            bar.set_postfix(postfix)
            if cfg.checkpoint is not None and rank == 0:
                save_torch(
                    cfg.checkpoint,
                    {
                        "epoch": epoch + 1,
                        "config": run_config,
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "schedulers": [s.state_dict() for s in schedulers],
                        "generator": gen.get_state(),
                        "torch_rng": torch.get_rng_state(),
                        "history": hist,
                        "best": best,
                        "bad_epochs": bad_epochs,
                        "best_state": best_state,
                    },
                )
    finally:
        bar.close()
        for cb in callbacks:
            if isinstance(cb, Callback):
                cb.on_train_end(model, hist)
    if best_state is not None and hist.stopped_early:
        model.load_state_dict(best_state)
    return hist
