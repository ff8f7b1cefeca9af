"""The guards of the training loop: the checks of the data it is given and the diagnosis of a
run that diverges. A leaf of the package (it imports no other training module).

Nothing goes silently wrong:

* **Divergence.** A step *diverges* when its loss is non-finite, or finite but more than
  :data:`DIVERGENCE_FACTOR` (``TrainConfig.divergence_factor``) times ``max(|L0|, 1)``, where
  L0 is the run's first loss (:attr:`~dselectk.training.History.first_loss`): see
  :func:`loss_diverged`. Such a step (or non-finite gradients) stops training with a
  :class:`TrainingDivergedError` (a ``FloatingPointError``) naming the step, the epoch, the task
  and what in the batch or the model caused it, e.g. ``training diverged at step 12 (epoch 1):
  the loss of task 1 (ys[1]) is nan; the targets ys[1] of this batch hold NaN/inf``.
  ``TrainConfig(nonfinite="skip")`` skips such steps instead, ``"warn"`` trains on. The loss
  check reuses the loss value the loop reads every step anyway (no extra host sync); gradients
  are checked every step only in ``"skip"`` mode, otherwise when a loss goes non-finite (the
  previous step's gradients and the parameters are inspected to name the cause) and, with the
  parameters, once at the end of every epoch.
* **Targets are checked** once, at the first step, against the model's outputs for the named
  losses ("mse", "bce", "ce"): shapes, class indices and value ranges, with a ``ValueError``
  naming the task and what was expected. Validation data is checked before training: no
  examples, or NaN/inf in its inputs or targets, is a ``ValueError`` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from dselectk.training.tasks import TaskData

__all__ = ["DIVERGENCE_FACTOR", "TrainingDivergedError", "loss_diverged"]

#: a finite loss above this many times ``max(|first loss|, 1)`` counts as diverged (the default
#: of ``TrainConfig.divergence_factor``): far beyond any loss a healthy run reaches from its
#: start (an initial loss ~1 ending at 1e6), far below what an exploded one reports (1e13 and up)
DIVERGENCE_FACTOR = 1e6


def loss_diverged(
    value: float, first: float | None, factor: float | None = DIVERGENCE_FACTOR
) -> bool:
    """Whether a loss ``value`` counts as diverged: non-finite, or (with a ``factor``) above
    ``factor * max(|first|, 1)``, where ``first`` is the run's first loss (None: unknown yet,
    only finiteness is checked).

    Examples:
        >>> loss_diverged(float("nan"), 1.0)
        True
        >>> loss_diverged(2e6, 1.0), loss_diverged(5e5, 1.0), loss_diverged(5e5, None)
        (True, False, False)
    """
    if not math.isfinite(value):
        return True
    if factor is None or first is None or not math.isfinite(first):
        return False
    return value > divergence_bound(first, factor)


def divergence_bound(first: float, factor: float) -> float:
    """The largest loss that does not count as diverged: ``factor * max(|first|, 1)``."""
    return factor * max(abs(first), 1.0)


class TrainingDivergedError(FloatingPointError):
    """Training produced a diverged loss (non-finite, or far above its start), or a non-finite
    gradient or parameter.

    Attributes:
        step: the 1-based index of the batch over the whole run (the steps of earlier epochs,
            skipped ones included, plus the batch's position in its epoch).
        epoch: the 1-based epoch.
        tasks: the tasks whose loss was non-finite (empty when unknown: ``loss_fn`` gives only
            the total, or the failure was in the gradients or parameters).

    Examples:
        >>> from dselectk.training import TaskData, TrainConfig, train
        >>> data = TaskData(torch.randn(16, 4), [torch.full((16, 1), float("nan"))])  # NaN targets
        >>> try:
        ...     train(nn.Linear(4, 1), data, "mse", TrainConfig(epochs=1, progress=False))
        ... except TrainingDivergedError as e:
        ...     print(e.step, e.epoch, e.tasks)
        ...     print(e)
        1 1 [0]
        training diverged at step 1 (epoch 1): the loss of task 0 (ys[0]) is nan; the targets
        ys[0] of this batch hold NaN/inf
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


def dist_rank_world() -> tuple[int, int]:
    """This process's rank and the number of processes (0 and 1 without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def check_data(name: str, data: TaskData) -> None:
    """Refuse ``data`` (named ``name``, e.g. "val_data") with no examples or NaN/inf in its
    inputs or targets: a ``ValueError`` naming the field and the task."""
    if len(data) == 0:
        raise ValueError(f"{name} has no examples (x has shape {tuple(data.x.shape)})")
    fields = [("x", "inputs", data.x)] + [
        (f"ys[{t}]", f"targets of task {t}", y) for t, y in enumerate(data.ys)
    ]
    for field, what, t in fields:
        if t.is_floating_point() or t.is_complex():
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                count, first = int(bad.sum()), int(bad.reshape(len(t), -1).any(1).nonzero()[0])
                raise ValueError(
                    f"{name}.{field} (the {what}) holds {count} NaN/inf value(s), the first in "
                    f"example {first}; every validation loss would be NaN. Drop or impute them"
                )


def _shape(shape: Sequence[int], lead: str = "N") -> str:
    return "(" + ", ".join([lead, *map(str, shape)]) + (",)" if not shape else ")")


def check_targets(
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


def all_finite(tensors: Sequence[Tensor]) -> bool:
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


def diverged(
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
    first: float | None = None,
    factor: float | None = None,
) -> TrainingDivergedError:
    """The error of a diverged loss at ``step`` (non-finite, or finite and above the bound of
    :func:`loss_diverged` for the run's ``first`` loss and ``factor``), naming the task and the
    likely cause."""
    tasks: list[int] = []
    if other_rank is not None:
        what = f"the loss on rank {other_rank} diverged (this rank's loss is {value:.6g})"
    elif math.isfinite(value) and first is not None and factor is not None:
        parts = ""
        if task_losses is not None:
            parts = f" (task losses {[f'{float(lt.detach()):.3g}' for lt in task_losses]})"
        return TrainingDivergedError(
            f"training diverged at step {step} (epoch {epoch}): the loss {value:.4g}{parts} is "
            f"above {factor:g} x max(|first loss|, 1) = {divergence_bound(first, factor):.4g} "
            f"(the run's first loss: {first:.4g}; TrainConfig.divergence_factor); lower the "
            f"learning rate",
            step=step,
            epoch=epoch,
        )
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


def gradients_diverged(
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


def parameters_diverged(model: nn.Module, epoch: int, step: int) -> TrainingDivergedError:
    """The error of parameters found non-finite at the end of ``epoch`` (by ``step``)."""
    names = _nonfinite_names([(n, p.detach()) for n, p in model.named_parameters()])
    return TrainingDivergedError(
        f"training diverged in epoch {epoch} (by step {step}): the parameters {names} are "
        f"non-finite although every loss was finite (non-finite gradients or an overflowing "
        f"update); lower the learning rate",
        step=step,
        epoch=epoch,
    )


def first_bad_rank(bad: bool, rank: int, device: torch.device) -> int | None:
    """Under DDP, the highest rank whose loss is non-finite (the same answer on every rank, so
    all of them raise or skip together), else None."""
    flag = torch.tensor([rank + 1 if bad else 0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    worst = int(flag.item())
    return worst - 1 if worst else None
