"""The training loop: :func:`train` is a short sequence of named steps on a :class:`_Run`
(resume, shard, step, guards, validate, early stop, end). Its settings are in
:mod:`~dselectk.training.config`, its data and losses in :mod:`~dselectk.training.tasks`, its
checks in :mod:`~dselectk.training.guards`, its checkpoints in
:mod:`~dselectk.training.checkpoint` and its hooks in :mod:`~dselectk.training.callbacks`."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dselectk.io import save_torch
from dselectk.optim import make_optimizer
from dselectk.progress import tqdm
from dselectk.training import checkpoint
from dselectk.training.callbacks import Callback, step_hooks
from dselectk.training.config import (
    BatchLossFn,
    TrainConfig,
    seed_everything,
    train_threads,
)
from dselectk.training.guards import (
    TrainingDivergedError,
    all_finite,
    check_targets,
    dist_rank_world,
    diverged,
    first_bad_rank,
    gradients_diverged,
    loss_diverged,
    parameters_diverged,
)
from dselectk.training.search import model_searches
from dselectk.training.state import History, RunState
from dselectk.training.tasks import (
    LossFn,
    TaskData,
    evaluate,
    first_member,
    loss_names,
    run_losses,
    task_loss,
    task_outputs,
)

__all__ = ["train"]


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
    """Train a multi-task model, or any model family of the library.

    Each step minimises Σ_t w_t ℓ_t(batch) + aux_loss (or ``loss_fn(model, batch)``), then
    steps every scheduler and calls every callback. The model's output is read by
    :func:`~dselectk.training.tasks.task_outputs`: a ``MultiTaskOutput``
    (:class:`~dselectk.models.MultiGateMoE`, :class:`~dselectk.models.SharedBottom`), a
    single-task output with ``output`` and ``aux_loss`` (:class:`~dselectk.models.MoE`,
    :class:`~dselectk.layers.SparseMoEFeedForward`), a :class:`~dselectk.models.MoEBank`
    (each task's loss sums its R members', as :meth:`~dselectk.models.MoEBank.loss`) or a plain
    tensor (one task).

    Args:
        model: e.g. :class:`~dselectk.models.MultiGateMoE` or
            :class:`~dselectk.models.SharedBottom`.
        train_data: training inputs and targets.
        losses: one loss for all tasks or one per task (a name in :data:`LOSSES` or a callable
            ``(pred, target) -> scalar``, averaged over the batch); None with ``loss_fn``.
        config: the settings; default :class:`TrainConfig()`.
        val_data: evaluated after every epoch (needed for early stopping); checked before
            training (examples, one target tensor per task, no NaN/inf).
        schedulers: stepped after every optimizer step: the schedules of gate
            hyperparameters, ``Ramp(...).scheduler(gates, steps)``
            (:class:`~dselectk.schedules.Ramp`), or anything with ``step()`` (with a
            checkpoint, also ``state_dict``/``load_state_dict``).
        optimizer: overrides ``config.optimizer``/``lr`` (e.g.
            :func:`~dselectk.optim.make_optimizer` with ``defaults="tf"``).
        callbacks: :class:`Callback` objects (``on_step`` after every step, after the
            schedulers; ``on_epoch`` after every epoch), or callables ``f(model, history)``
            called after every step, e.g. to track when the gates become binary.
        loss_fn: ``(model, batch) -> (loss, output)``, the whole training loss of a batch
            (task losses, weights and auxiliary losses included); replaces ``losses`` for
            training (a vectorized model's fused loss, say).

    Returns:
        The :class:`History`. With early stopping, the model ends with its best weights.

    Raises:
        TrainingDivergedError: a step diverged (a non-finite loss or gradient, or a loss far
            above its start: ``TrainConfig.divergence_factor``), or a validation loss was
            non-finite, with ``nonfinite="raise"``.

    Examples:
        >>> from dselectk.gates import make_gate
        >>> from dselectk.layers import StackedMLP, make_towers
        >>> from dselectk.models import MultiGateMoE
        >>> x = torch.randn(64, 4)
        >>> data = TaskData(x, [x[:, :1] * 2, x[:, 1:2] - x[:, 2:3]])
        >>> model = MultiGateMoE(
        ...     StackedMLP(4, 4, [8], final_activation=True),
        ...     make_gate("softmax", 4, num_gates=2),
        ...     make_towers(2, 8, [1]),
        ... )
        >>> hist = train(model, data, "mse", TrainConfig(epochs=2, progress=False))
        >>> len(hist.train_loss), hist.diverged
        (2, False)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(train_data, TaskData):
        raise TypeError(f"train_data must be a TaskData, got {type(train_data).__name__}")
    cfg = config or TrainConfig()
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(cfg).__name__}")
    if isinstance(callbacks, (str, bytes, Callback)) or not isinstance(callbacks, Sequence):
        raise TypeError(
            "callbacks must be a list of Callback objects or callables (wrap a single one in a "
            f"list), got the {type(callbacks).__name__} {callbacks!r}"
        )
    if isinstance(schedulers, (str, bytes)) or not isinstance(schedulers, Sequence):
        raise TypeError(
            f"schedulers must be a list of schedulers, got the {type(schedulers).__name__} "
            f"{schedulers!r}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer over the model's parameters, or None "
            f"(then TrainConfig.optimizer names it), got the {type(optimizer).__name__} "
            f"{optimizer!r}"
        )
    if cfg.checkpoint is not None:
        checkpoint.check_path(cfg.checkpoint)
    if cfg.seed is not None:
        seed_everything(cfg.seed)
    run = _Run(model, train_data, losses, cfg, val_data, schedulers, optimizer, callbacks, loss_fn)
    start_epoch = run.resume()
    model.train()
    threads, before = train_threads(cfg, model), torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        for epoch in range(start_epoch, cfg.epochs):
            if not run.epoch(epoch):
                break
    finally:
        run.end()
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
    return run.restore_best()


class _Run:
    """One :func:`train` call: its fixed setup, and its :class:`RunState` (:attr:`state`, what
    checkpoints save); each method is one named step of the loop."""

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
        self.fns, self.weights = run_losses(losses, loss_fn, val_data, cfg, len(data.ys))
        self.model, self.data, self.val_data, self.cfg = model, data, val_data, cfg
        self.losses, self.loss_fn = losses, loss_fn
        opt = optimizer or make_optimizer(
            cfg.optimizer, model.parameters(), cfg.lr, cfg.weight_decay
        )
        shuffle_seed = cfg.shuffle_seed if cfg.shuffle_seed is not None else cfg.seed
        gen = torch.Generator().manual_seed(shuffle_seed if shuffle_seed is not None else 0)
        searches: list[Callback] = []
        if cfg.search is not None and (loss_fn is None or cfg.search != "auto"):
            if loss_fn is not None and losses is None:
                raise ValueError(
                    "search: a SearchPlan scores each gate by its task's loss; with loss_fn, pass "
                    "losses too, or search=None"
                )
            steps = cfg.epochs * math.ceil(
                (len(data) // max(dist_rank_world()[1], 1)) / cfg.batch_size
            )
            searches = list(
                model_searches(model, data, self.fns, cfg.search, steps, shuffle_seed or 0)
            )
        self.searches = searches
        callbacks = [*callbacks, *searches]
        self.callbacks = [cb for cb in callbacks if isinstance(cb, Callback)]
        self.step_hooks = step_hooks(callbacks)
        self.rank, self.world = dist_rank_world()
        self.shard = len(data) // self.world  # equal shards: every rank runs the same steps
        if self.shard == 0:
            raise ValueError(
                f"train_data has {len(data)} examples, fewer than the {self.world} processes"
            )
        self.steps_per_epoch = math.ceil(self.shard / cfg.batch_size)
        self.per_step = cfg.progress_unit == "step"
        self.kinds = loss_names(losses, len(self.fns)) if losses is not None else []
        self.check_targets = loss_fn is None and any(k is not None for k in self.kinds)
        self.params = [p for p in model.parameters() if p.requires_grad]
        digests = None  # the data's content, checked on resume (hashed only with a checkpoint)
        if cfg.checkpoint is not None:
            digests = {
                "train_data": checkpoint.data_digest(data),
                "val_data": checkpoint.data_digest(val_data),
            }
        config = checkpoint.run_config(
            cfg, model, opt, losses, loss_fn, schedulers, len(data), self.world, digests
        )
        self.state = RunState(model, opt, schedulers, gen, config)
        self.bar = tqdm(
            total=cfg.epochs * (self.steps_per_epoch if self.per_step else 1),
            disable=not cfg.progress or self.rank != 0,
            unit="step" if self.per_step else "ep",
            desc=cfg.desc or None,
            position=cfg.position,
            leave=cfg.position is None,
        )
        self.warned: set[str] = set()
        self.exploded = False  # whether the last diverged loss was finite (too large)

    @property
    def hist(self) -> History:
        return self.state.history

    def resume(self) -> int:
        """Restore the checkpoint, if there is one, after checking it; the epoch to start
        from."""
        cfg = self.cfg
        if cfg.checkpoint is None or not Path(cfg.checkpoint).is_file():
            return 0
        done = checkpoint.load(
            cfg.checkpoint, self.state, cfg.resume, allow_nonfinite=cfg.nonfinite == "warn"
        )
        start_epoch = cfg.epochs if self.hist.stopped_early else done
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
            val_total = self.validate(epoch + 1)
            postfix["val"] = f"{val_total:.4g}"
            if self.early_stop(epoch, val_total):
                return False
        for cb in self.callbacks:
            cb.on_epoch(self.model, epoch + 1, self.hist)
        if not self.per_step:
            self.bar.update(1)
        self.bar.set_postfix(postfix)
        if self.cfg.checkpoint is not None and self.rank == 0:
            save_torch(self.cfg.checkpoint, checkpoint.save_state(self.state, epoch + 1))
        return True

    def shard_order(self) -> Tensor:
        """This epoch's shuffled order (the same on every rank), cut to this rank's shard."""
        perm = torch.randperm(len(self.data), generator=self.state.generator)
        if self.world > 1:
            perm = perm[: self.shard * self.world].view(self.shard, self.world)[:, self.rank]
        return perm

    def step(self, step_no: int, epoch: int, idx: Tensor) -> float | None:
        """One optimizer step on the examples ``idx``, guarded; the loss, or None if skipped."""
        batch = self.data.batch(idx)
        opt = self.state.optimizer
        loss, value, out, error = self.loss(step_no, epoch, batch)
        opt.zero_grad(set_to_none=True)
        if error is None or self.cfg.nonfinite == "warn":
            loss.backward()
            if self.cfg.nonfinite == "skip" and error is None:
                error = self.guard_gradients(step_no, epoch, value)
                self.exploded = False
        if error is not None:
            self.count_diverged(error, self.exploded and math.isfinite(value))
            if self.cfg.nonfinite == "skip":
                opt.zero_grad(set_to_none=True)
                return None
        opt.step()
        for sched in self.state.schedulers:
            sched.step()
        self.hist.steps += 1
        for hook in self.step_hooks:
            hook(self.model, batch, out, self.hist)
        return value

    def loss(
        self, step_no: int, epoch: int, batch: TaskData
    ) -> tuple[Tensor, float, Any, TrainingDivergedError | None]:
        """The batch's training loss, its value and the model's output, with the loss guard: the
        error of a diverged loss (on any rank), raised unless ``nonfinite`` is skip or warn."""
        task_losses: list[Tensor] | None = None
        aux: Any = None
        if self.loss_fn is not None:
            loss, out = self.loss_fn(self.model, batch)
        else:
            out = self.model(batch.x)
            preds, aux, members = task_outputs(self.model, out)
            if len(preds) != len(self.fns):
                raise ValueError(f"model has {len(preds)} task outputs but {len(self.fns)} losses")
            if self.check_targets:
                check_targets(self.kinds, first_member(preds, members), self.data.ys)
                self.check_targets = False
            task_losses = [
                task_loss(fn, p, y, members) for fn, p, y in zip(self.fns, preds, batch.ys)
            ]
            loss = sum(w * lt for w, lt in zip(self.weights, task_losses)) + aux
        value = float(loss.detach())  # the loop's one host sync per step
        hist, factor = self.hist, self.cfg.divergence_factor
        bad = loss_diverged(value, hist.first_loss, factor)
        other = first_bad_rank(bad, self.rank, loss.device) if self.world > 1 else None
        if not bad and other is None:
            if hist.first_loss is None:
                hist.first_loss = value
            return loss, value, out, None
        self.exploded = bad and math.isfinite(value)
        error = diverged(
            step=step_no,
            epoch=epoch,
            model=self.model,
            batch=batch,
            value=value,
            task_losses=task_losses,
            weights=self.weights,
            aux=aux,
            other_rank=None if bad else other,
            first=hist.first_loss,
            factor=factor,
        )
        if self.cfg.nonfinite == "raise":
            raise error
        return loss, value, out, error

    def guard_gradients(self, step: int, epoch: int, value: float) -> TrainingDivergedError | None:
        """The error of non-finite gradients under a finite loss (checked in "skip" mode)."""
        if all_finite([p.grad for p in self.params if p.grad is not None]):
            return None
        return gradients_diverged(self.model, step, epoch, value)

    def count_diverged(self, error: TrainingDivergedError, exploded: bool) -> None:
        """Count a diverged step that is skipped or trained through; warn about the first."""
        if exploded:
            self.hist.exploded_steps += 1
        else:
            self.hist.nonfinite_steps += 1
        action = "skipping" if self.cfg.nonfinite == "skip" else "training on through"
        self.warn(
            "step",
            f"{error}. nonfinite={self.cfg.nonfinite!r}: {action} such steps (counted in "
            f"History.nonfinite_steps and History.exploded_steps)",
            stacklevel=6,  # the caller of train: train -> epoch -> step -> count -> warn
        )

    def warn(self, kind: str, message: str, stacklevel: int) -> None:
        """Warn about the first event of each ``kind`` of a run."""
        if kind in self.warned:
            return
        self.warned.add(kind)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)

    def guard_parameters(self, epoch: int) -> None:
        """At the end of 1-based ``epoch``: non-finite parameters stop the run (but with "warn")."""
        if self.cfg.nonfinite != "warn" and not all_finite([p.detach() for p in self.params]):
            raise parameters_diverged(self.model, epoch, epoch * self.steps_per_epoch)

    def validate(self, epoch: int) -> float:
        """Evaluate the validation data, record its task losses; their weighted sum. A
        non-finite one diverged: raised with ``nonfinite="raise"``, else counted."""
        assert self.losses is not None and self.val_data is not None  # checked by run_losses
        val = evaluate(self.model, self.val_data, self.losses)["loss"]
        self.hist.val_losses.append(val)
        total = sum(w * v for w, v in zip(self.weights, val))
        if math.isfinite(total):
            return total
        tasks = [t for t, v in enumerate(val) if not math.isfinite(v)]
        step = epoch * self.steps_per_epoch
        error = TrainingDivergedError(
            f"training diverged in epoch {epoch} (by step {step}): the validation loss of "
            + (f"task(s) {tasks}" if tasks else "the tasks (weighted sum)")
            + f" is non-finite ({val}) although the validation data is finite; lower the "
            f"learning rate",
            step=step,
            epoch=epoch,
            tasks=tasks,
        )
        if self.cfg.nonfinite == "raise":
            raise error
        self.hist.nonfinite_val_epochs += 1
        self.warn(
            "validation",
            f"{error}. nonfinite={self.cfg.nonfinite!r}: counted in "
            "History.nonfinite_val_epochs; such an epoch is never the best",
            stacklevel=5,  # the caller of train: train -> epoch -> validate -> warn
        )
        return total

    def early_stop(self, epoch: int, val_total: float) -> bool:
        """Track the best validation loss (and weights); whether patience has run out."""
        st = self.state
        if val_total < st.best:
            st.best, st.bad_epochs, self.hist.best_epoch = val_total, 0, epoch
            if self.cfg.early_stopping_patience is not None:
                st.best_state = copy.deepcopy(self.model.state_dict())
            return False
        st.bad_epochs += 1
        patience = self.cfg.early_stopping_patience
        if patience is not None and st.bad_epochs >= patience:
            self.hist.stopped_early = True
            if self.hist.best_epoch is None:
                self.warn(
                    "no best",
                    f"early stopping after {st.bad_epochs} epoch(s) without a finite "
                    "validation loss: no best epoch (History.best_epoch is None), the model "
                    "keeps its last weights",
                    stacklevel=5,  # the caller of train: train -> epoch -> early_stop -> warn
                )
            return True
        return False

    def end(self) -> None:
        """Close the progress bar and tell the callbacks (also after an error)."""
        self.bar.close()
        for cb in self.callbacks:
            cb.on_train_end(self.model, self.hist)

    def restore_best(self) -> History:
        """After early stopping, load the best weights; the history."""
        if self.state.best_state is not None and self.hist.stopped_early:
            self.model.load_state_dict(self.state.best_state)
        return self.hist
