"""The guards of the training loop (:mod:`dselectk.training`): the checks of its settings and
arguments, target checks, the divergence guard's diagnosis, and the checkpoints (the state and
configuration they carry, the check of it on resuming). Kept apart from the loop so the loop
reads as a loop.

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

import hashlib
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from dselectk.gates.base import check_nonnegative, check_positive_int
from dselectk.gates.hyperparameter import hyperparameters
from dselectk.tasks import _resolve_losses

if TYPE_CHECKING:
    from dselectk.tasks import LossFn, TaskData
    from dselectk.training import TrainConfig, _Run

__all__ = ["CheckpointMismatchError", "TrainingDivergedError"]


class TrainingDivergedError(FloatingPointError):
    """Training produced a non-finite loss, gradient or parameter.

    Attributes:
        step: the 1-based index of the batch over the whole run (the steps of earlier epochs,
            skipped ones included, plus the batch's position in its epoch).
        epoch: the 1-based epoch.
        tasks: the tasks whose loss was non-finite (empty when unknown: ``loss_fn`` gives only
            the total, or the failure was in the gradients or parameters).
    """

    def __init__(self, message: str, *, step: int, epoch: int, tasks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.epoch = epoch
        self.tasks = list(tasks)

    def __reduce__(self) -> tuple[Any, ...]:
        # keyword-only fields: the default reduction would fail to unpickle it in the parent
        # process of a worker pool (a BrokenProcessPool instead of this error)
        return (_diverged_error, (str(self), self.step, self.epoch, self.tasks))


def _diverged_error(message: str, step: int, epoch: int, tasks: list[int]) -> TrainingDivergedError:
    return TrainingDivergedError(message, step=step, epoch=epoch, tasks=tasks)


class CheckpointMismatchError(ValueError):
    """A checkpoint was written with another training configuration than the one resuming it."""


def _check_config(cfg: TrainConfig) -> None:
    """Check the settings of a :class:`~dselectk.training.TrainConfig`."""
    if cfg.optimizer not in ("adam", "adagrad", "sgd"):
        raise ValueError(f"optimizer must be adam, adagrad or sgd, got {cfg.optimizer!r}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ValueError(f"lr must be a finite number > 0, got {cfg.lr}")
    if cfg.progress_unit not in ("step", "epoch"):
        raise ValueError(f"progress_unit must be step or epoch, got {cfg.progress_unit!r}")
    check_positive_int("batch_size", cfg.batch_size)
    check_positive_int("epochs", cfg.epochs, 0)
    if cfg.early_stopping_patience is not None:
        check_positive_int("early_stopping_patience", cfg.early_stopping_patience)
    check_nonnegative("weight_decay", cfg.weight_decay)
    if cfg.nonfinite not in ("raise", "skip", "warn"):
        raise ValueError(f"nonfinite must be raise, skip or warn, got {cfg.nonfinite!r}")
    if cfg.resume not in ("strict", "force"):
        raise ValueError(f"resume must be strict or force, got {cfg.resume!r}")
    if cfg.task_weights is not None:
        for w in cfg.task_weights:
            check_nonnegative("task_weights[i]", w)


def _task_losses(
    losses: str | LossFn | Sequence[str | LossFn] | None,
    loss_fn: Any,
    val_data: TaskData | None,
    cfg: TrainConfig,
    num_tasks: int,
) -> tuple[list[LossFn], list[float]]:
    """Check the losses, task weights and validation data of a run; the per-task loss functions
    and weights."""
    if losses is None and (loss_fn is None or val_data is not None):
        raise ValueError("losses is needed unless loss_fn is given and there is no val_data")
    fns = _resolve_losses(losses, num_tasks) if losses is not None else []
    weights = list(cfg.task_weights) if cfg.task_weights is not None else [1.0] * len(fns)
    if fns and len(weights) != len(fns):
        raise ValueError(
            f"task_weights must have one weight per task ({len(fns)}), got {len(weights)}"
        )
    if cfg.early_stopping_patience is not None and val_data is None:
        raise ValueError("early_stopping_patience needs val_data")
    if val_data is not None and len(val_data.ys) != num_tasks:
        raise ValueError(
            f"val_data has {len(val_data.ys)} target tensor(s) (ys) but train_data has "
            f"{num_tasks}: one per task in both"
        )
    return fns, weights


def _dist_rank_world() -> tuple[int, int]:
    """This process's rank and the number of processes (0 and 1 without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _shape(shape: Sequence[int], lead: str = "N") -> str:
    return "(" + ", ".join([lead, *map(str, shape)]) + (",)" if not shape else ")")


def _check_targets(
    kinds: Sequence[str | None], preds: Sequence[Tensor], ys: Sequence[Tensor]
) -> None:
    """Check the targets of the named losses against the model's outputs (of the first batch)."""
    for t, (kind, pred, y) in enumerate(zip(kinds, preds, ys)):
        if kind is None:
            continue
        name = f"task {t} (ys[{t}], loss {kind!r})"
        per_pred, per_y = tuple(pred.shape[1:]), tuple(y.shape[1:])
        if kind in ("mse", "bce"):
            if math.prod(per_pred) != math.prod(per_y):
                raise ValueError(
                    f"{name}: the model predicts {math.prod(per_pred)} value(s) per example "
                    f"(output {_shape(per_pred, 'B')}) but the targets have shape "
                    f"{_shape(per_y)}; expected targets of shape {_shape(per_pred)} (or any "
                    f"shape with {math.prod(per_pred)} value(s) per example)"
                )
            if kind == "bce" and y.numel():
                lo, hi = (float(v) for v in torch.aminmax(y.detach().to(torch.float64)))
                if lo < 0 or hi > 1:
                    raise ValueError(
                        f"{name}: binary cross-entropy needs targets in [0, 1], got values in "
                        f"[{lo:g}, {hi:g}]"
                    )
            continue
        if kind != "ce":
            continue
        if pred.dim() < 2:
            raise ValueError(
                f"{name}: cross-entropy needs class logits of shape (B, C), the model's output "
                f"has shape {_shape(per_pred, 'B')}"
            )
        classes = int(pred.shape[1])
        if classes < 2:
            raise ValueError(
                f"{name}: the model predicts {classes} class logit, and cross-entropy over one "
                f"class is always 0 (nothing would train; targets: {y.dtype} of shape "
                f"{_shape(per_y)}); for a binary task use loss 'bce' with one logit, for C "
                f"classes predict C logits and give integer class indices of shape (N,)"
            )
        if y.is_floating_point():
            if per_y != per_pred:
                raise ValueError(
                    f"{name}: float targets are class probabilities and must have shape "
                    f"{_shape(per_pred)}, got {_shape(per_y)}; give class indices as an integer "
                    f"tensor of shape {_shape(per_pred[1:])}"
                )
            if y.numel():
                lo, hi = (float(v) for v in torch.aminmax(y.detach()))
                if lo < 0 or hi > 1:
                    raise ValueError(
                        f"{name}: class probabilities must lie in [0, 1], got values in "
                        f"[{lo:g}, {hi:g}]"
                    )
            continue
        if y.dtype == torch.bool or y.is_complex():
            raise ValueError(
                f"{name}: cross-entropy needs integer class indices (or float class "
                f"probabilities), got {y.dtype}"
            )
        if per_y != per_pred[1:]:
            raise ValueError(
                f"{name}: class indices must have shape {_shape(per_pred[1:])} for logits of "
                f"shape {_shape(per_pred, 'B')}, got {_shape(per_y)}"
            )
        bad = ((y < 0) | (y >= classes)) & (y != -100)  # -100: cross_entropy's ignore_index
        if bool(bad.any()):
            lo, hi = int(y.min()), int(y.max())
            raise ValueError(
                f"{name}: class indices must lie in [0, {classes}) for {classes} class logits, "
                f"got values in [{lo}, {hi}]"
            )


def _all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite (one fused max-norm, one host sync)."""
    if not tensors:
        return True
    norms = torch._foreach_norm(list(tensors), math.inf)  # max |x|: no overflow, NaN propagates
    return bool(torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms]).max()))


def _nonfinite_names(named: Sequence[tuple[str, Tensor | None]], limit: int = 3) -> str:
    bad = [name for name, t in named if t is not None and not bool(torch.isfinite(t).all())]
    more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
    return ", ".join(bad[:limit]) + more


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _data_cause(batch: TaskData, tasks: Sequence[int]) -> str:
    causes = []
    if batch.x.is_floating_point() and not bool(torch.isfinite(batch.x).all()):
        causes.append("the inputs x of this batch hold NaN/inf")
    for t in tasks or range(len(batch.ys)):
        y = batch.ys[t]
        if y.is_floating_point() and not bool(torch.isfinite(y).all()):
            causes.append(f"the targets ys[{t}] of this batch hold NaN/inf")
    return "; ".join(causes)


def _diverged(
    *,
    step: int,
    epoch: int,
    model: nn.Module,
    batch: TaskData,
    value: float,
    task_losses: Sequence[Tensor] | None,
    weights: Sequence[float],
    aux: Tensor | float | None,
    other_rank: int | None,
) -> TrainingDivergedError:
    """The error of a non-finite loss at ``step``, naming the task and the likely cause."""
    tasks: list[int] = []
    if other_rank is not None:
        what = f"the loss on rank {other_rank} is non-finite (this rank's loss is {value:.6g})"
    elif task_losses is not None:
        vals = [float(lt.detach()) for lt in task_losses]
        tasks = [t for t, v in enumerate(vals) if not math.isfinite(v)]
        aux_v = float(aux.detach()) if isinstance(aux, Tensor) else float(aux or 0.0)
        if len(tasks) == 1:
            what = f"the loss of task {tasks[0]} (ys[{tasks[0]}]) is {_fmt(vals[tasks[0]])}"
        elif tasks:
            what = "the losses of tasks " + ", ".join(f"{t} ({_fmt(vals[t])})" for t in tasks)
        elif not math.isfinite(aux_v):
            what = f"the model's auxiliary loss is {_fmt(aux_v)} (the task losses are finite)"
        else:
            what = (
                f"the loss is {_fmt(value)}: the task losses {[f'{v:.3g}' for v in vals]} with "
                f"weights {list(weights)} overflowed"
            )
    else:
        what = f"the loss is {_fmt(value)} (loss_fn gives only the total: the task is not known)"
    named = list(model.named_parameters())
    bad_params = _nonfinite_names([(n, p.detach()) for n, p in named])
    if bad_params:
        bad_grads = _nonfinite_names([(n, p.grad) for n, p in named])
        cause = (
            f"the parameters {bad_params} are already non-finite: "
            + (
                f"the gradients of {bad_grads} at the previous step were non-finite"
                if bad_grads
                else "an earlier update overflowed"
            )
            + "; lower the learning rate"
        )
    else:
        cause = (
            _data_cause(batch, tasks)
            or "lower the learning rate or check the targets (NaN/inf in the data)"
        )
    return TrainingDivergedError(
        f"training diverged at step {step} (epoch {epoch}): {what}; {cause}",
        step=step,
        epoch=epoch,
        tasks=tasks,
    )


def _gradients_diverged(
    model: nn.Module, step: int, epoch: int, value: float
) -> TrainingDivergedError:
    """The error of non-finite gradients under a finite loss ``value``."""
    names = _nonfinite_names([(n, p.grad) for n, p in model.named_parameters()])
    return TrainingDivergedError(
        f"training diverged at step {step} (epoch {epoch}): the loss is finite ({value:.6g}) "
        f"but the gradients of {names} are not; lower the learning rate",
        step=step,
        epoch=epoch,
    )


def _parameters_diverged(model: nn.Module, epoch: int, step: int) -> TrainingDivergedError:
    """The error of parameters found non-finite at the end of ``epoch`` (by ``step``)."""
    names = _nonfinite_names([(n, p.detach()) for n, p in model.named_parameters()])
    return TrainingDivergedError(
        f"training diverged in epoch {epoch} (by step {step}): the parameters {names} are "
        f"non-finite although every loss was finite (non-finite gradients or an overflowing "
        f"update); lower the learning rate",
        step=step,
        epoch=epoch,
    )


def _plain(v: Any) -> Any:
    """A picklable, comparable form of a configuration value (tensors as lists)."""
    if isinstance(v, Tensor):
        return v.detach().cpu().tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


_OPT_HPARAMS = (
    "lr",
    "betas",
    "eps",
    "momentum",
    "dampening",
    "nesterov",
    "weight_decay",
    "lr_decay",
    "initial_accumulator_value",
    "amsgrad",
    "maximize",
)


def _qualname(f: Any) -> str | None:
    if f is None:
        return None
    if isinstance(f, str):
        return f
    return str(getattr(f, "__qualname__", None) or type(f).__qualname__)


def _run_config(
    cfg: TrainConfig,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    losses: Any,
    loss_fn: Any,
    schedulers: Sequence[Any],
    n: int,
    world: int,
    data: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    """Everything that changes the trajectory of a run (saved with its checkpoints); ``data``:
    the content digests of the training and validation data (:func:`data_digest`)."""
    hp = {k: _plain(v) for k, v in opt.defaults.items() if k in _OPT_HPARAMS}
    if "lr" not in hp and hasattr(opt, "lr"):  # e.g. RowwiseAdam's per-member rates
        hp["lr"] = _plain(opt.lr)
    if losses is None or isinstance(losses, str) or callable(losses):
        loss_names: Any = _qualname(losses)
    else:
        loss_names = [_qualname(item) for item in losses]
    return {
        "optimizer": type(opt).__qualname__,
        **{f"optimizer.{k}": v for k, v in sorted(hp.items())},
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "shuffle_seed": cfg.shuffle_seed,
        "task_weights": _plain(cfg.task_weights),
        "early_stopping_patience": cfg.early_stopping_patience,
        "losses": loss_names,
        "loss_fn": _qualname(loss_fn),
        "schedulers": [type(s).__qualname__ for s in schedulers],
        "examples": n,
        "world_size": world,
        "parameters": {k: list(v.shape) for k, v in model.state_dict().items()},
        "hyperparameters": _gate_hyperparameters(model),
        "epochs": cfg.epochs,
        **({"data": data} if data is not None else {}),
    }


def data_digest(data: TaskData | None) -> str | None:
    """A digest of a dataset's content (inputs and every target: shapes, dtypes and bytes), so
    that a checkpoint is never resumed on other data of the same size."""
    if data is None:
        return None
    h = hashlib.blake2b(digest_size=16)
    for t in (data.x, *data.ys):
        t = t.detach()
        h.update(f"{tuple(t.shape)}{t.dtype};".encode())
        if t.numel():
            h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _gate_hyperparameters(model: nn.Module) -> dict[str, Any]:
    """Every gate hyperparameter (γ, λ, τ, μ: buffers that shape training) at the start of the
    run, by ``module.name``: a checkpoint's buffers would silently replace them on resume."""
    out: dict[str, Any] = {}
    for prefix, module in model.named_modules():
        for name in hyperparameters(module):
            try:
                value = getattr(module, name)
            except AttributeError:  # declared but never set (an optional one)
                continue
            out[f"{prefix}.{name}" if prefix else name] = _round7(_plain(value))
    return out


def _round7(v: Any) -> Any:
    """Float32 buffers to the 7 digits they hold (0.01, not 0.009999999776482582)."""
    if isinstance(v, list):
        return [_round7(x) for x in v]
    return float(f"{v:.7g}") if isinstance(v, float) else v


#: keys older checkpoints carry that no longer change a run (``record_every``: the recorder
#: shorthand of TrainConfig, now a callback)
_RETIRED_KEYS = ("record_every",)


#: keys newer than some checkpoints: a checkpoint without them cannot be checked on them
_ADDED_KEYS = ("hyperparameters", "data")


def _config_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    diffs = []
    for key in [*now, *(k for k in saved if k not in now and k not in _RETIRED_KEYS)]:
        if key in _ADDED_KEYS and key not in saved:
            continue
        a, b = saved.get(key, "<absent>"), now.get(key, "<absent>")
        if key == "hyperparameters" and isinstance(a, dict) and isinstance(b, dict):
            for name in sorted(set(a) | set(b)):
                va, vb = a.get(name, "<absent>"), b.get(name, "<absent>")
                if va != vb:
                    diffs.append(f"{name}: {va!r} in the checkpoint, {vb!r} now")
            continue
        if key == "epochs":
            if isinstance(a, int) and isinstance(b, int) and b < a:
                diffs.append(
                    f"epochs: {a} in the checkpoint, {b} now (only more epochs continue it)"
                )
        elif key == "parameters" and a != b:
            both = isinstance(a, dict) and isinstance(b, dict)
            names = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)) if both else []
            shown = ", ".join(
                f"{k} {a.get(k, 'absent')} -> {b.get(k, 'absent')}" for k in names[:3]
            )
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            diffs.append(f"parameters: {shown}{more}")
        elif key == "data" and a != b:
            a, b = a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {}
            names = [n for n in ("train_data", "val_data") if a.get(n) != b.get(n)]
            diffs.append(f"data: {' and '.join(names)} differ in content from the checkpoint's run")
        elif a != b:
            diffs.append(f"{key}: {a!r} in the checkpoint, {b!r} now")
    return diffs


def _check_resumable(
    path: str | Path, saved: dict[str, Any] | None, now: dict[str, Any], resume: str
) -> None:
    """Refuse a checkpoint written with another configuration (with ``resume="force"``: warn)."""
    if saved is None:
        diffs = ["the checkpoint carries no configuration (written by an older dselectk)"]
    else:
        diffs = _config_diff(saved, now)
    if not diffs:
        return
    listing = "; ".join(diffs)
    if resume != "force":
        raise CheckpointMismatchError(
            f"checkpoint {path} was written by a run with another configuration: {listing}. "
            f"Delete it to start over, or pass TrainConfig(resume='force') to resume it anyway"
        )
    warnings.warn(
        f"resuming checkpoint {path} despite another configuration (resume='force'): {listing}",
        RuntimeWarning,
        stacklevel=4,  # the caller of train: train -> _Run.resume -> here
    )


def _checkpoint_state(run: _Run, epoch: int) -> dict[str, Any]:
    """The full training state of ``run`` after 1-based ``epoch``: what a checkpoint holds."""
    return {
        "epoch": epoch,
        "config": run.config,
        "model": run.model.state_dict(),
        "optimizer": run.opt.state_dict(),
        "schedulers": [s.state_dict() for s in run.schedulers],
        "generator": run.gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "history": run.hist,
        "best": run.best,
        "bad_epochs": run.bad_epochs,
        "best_state": run.best_state,
    }


def _restore_state(run: _Run, state: dict[str, Any]) -> None:
    """Put a checkpoint's training state (see :func:`_checkpoint_state`) back into ``run``."""
    run.model.load_state_dict(state["model"])
    run.opt.load_state_dict(state["optimizer"])
    for s, st in zip(run.schedulers, state["schedulers"]):
        s.load_state_dict(st)
    run.gen.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    run.hist, run.best = state["history"], state["best"]
    run.bad_epochs, run.best_state = state["bad_epochs"], state["best_state"]


def _first_bad_rank(bad: bool, rank: int, device: torch.device) -> int | None:
    """Under DDP, the highest rank whose loss is non-finite (the same answer on every rank, so
    all of them raise or skip together), else None."""
    flag = torch.tensor([rank + 1 if bad else 0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    worst = int(flag.item())
    return worst - 1 if worst else None
