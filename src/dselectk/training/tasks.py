"""Multi-task data and losses: :class:`TaskData` (inputs shared by the tasks, one target tensor
per task), the named per-task losses (:data:`LOSSES`), how a model's output becomes per-task
predictions (:func:`task_outputs`, for every model family of the library) and :func:`evaluate`.
:mod:`dselectk.training` re-exports the public names."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dselectk.models.bank import MoEBank
from dselectk.training.guards import check_data, check_targets

if TYPE_CHECKING:
    from dselectk.training.config import TrainConfig

__all__ = ["LOSSES", "LossFn", "TaskData", "TaskOutputs", "evaluate", "task_outputs"]

LossFn = Callable[[Tensor, Tensor], Tensor]


def _mse(pred: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(pred.reshape(y.shape), y)


def _bce(pred: Tensor, y: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(pred.reshape(y.shape), y.to(pred.dtype))


LOSSES: dict[str, LossFn] = {"mse": _mse, "bce": _bce, "ce": F.cross_entropy}
"""Named per-task losses: mean squared error, binary cross-entropy on logits, cross-entropy."""


@dataclass
class TaskData:
    """Inputs shared by all tasks and one target tensor per task (first dim: examples).

    Args:
        x: (N, ...) inputs.
        ys: a list of T target tensors, ``ys[t]`` of shape (N, ...) (a tuple is taken as a
            list); one task is ``TaskData(x, [y])``.

    Examples:
        >>> x = torch.randn(8, 3)
        >>> data = TaskData(x, [x.sum(1, keepdim=True), (x[:, 0] > 0).float()])
        >>> len(data), len(data.ys)
        (8, 2)
    """

    x: Tensor
    ys: list[Tensor]

    def __post_init__(self) -> None:
        if not isinstance(self.x, Tensor):
            raise TypeError(f"x must be a Tensor of inputs (N, ...), got {type(self.x).__name__}")
        if isinstance(self.ys, Tensor):
            raise TypeError(
                f"ys must be a list of target tensors, one per task (e.g. TaskData(x, [y]) for "
                f"one task), got a Tensor of shape {tuple(self.ys.shape)}"
            )
        if not isinstance(self.ys, (list, tuple)):
            raise TypeError(
                f"ys must be a list of target tensors, one per task, got {type(self.ys).__name__}"
            )
        self.ys = list(self.ys)
        if not self.ys:
            raise ValueError("ys must hold one target tensor per task")
        if self.x.dim() == 0:
            raise ValueError("x must have a first dimension of examples, got a 0-d tensor")
        n = self.x.shape[0]
        for i, y in enumerate(self.ys):
            if not isinstance(y, Tensor):
                raise TypeError(f"ys[{i}] must be a Tensor of targets, got {type(y).__name__}")
            if y.dim() == 0:
                raise ValueError(f"ys[{i}] must have a first dimension of examples, got 0-d")
            if y.shape[0] != n:
                raise ValueError(f"ys[{i}] has {y.shape[0]} rows but x has {n}")

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def batch(self, idx: Tensor) -> TaskData:
        return TaskData(self.x[idx], [y[idx] for y in self.ys])


def _resolve_losses(losses: str | LossFn | Sequence[str | LossFn], num_tasks: int) -> list[LossFn]:
    if isinstance(losses, str) or callable(losses):
        items = [losses] * num_tasks
    elif isinstance(losses, (list, tuple)):
        items = list(losses)
    else:
        raise TypeError(
            f"losses must be a loss name ({sorted(LOSSES)}), a loss function or a list of them "
            f"(one per task), got the {type(losses).__name__} {losses!r}"
        )
    if len(items) != num_tasks:
        raise ValueError(f"losses must name one loss per task ({num_tasks}), got {len(items)}")
    out = []
    for item in items:
        if isinstance(item, str):
            if item not in LOSSES:
                raise ValueError(f"unknown loss {item!r}; expected one of {sorted(LOSSES)}")
            out.append(LOSSES[item])
        elif callable(item):
            out.append(item)
        else:
            raise TypeError(f"losses: each loss must be a name or a function, got {item!r}")
    return out


class TaskOutputs(NamedTuple):
    """A model's output read as one prediction per task (see :func:`task_outputs`).

    Examples:
        >>> from dselectk import MultiGateMoE, SoftmaxGate
        >>> from dselectk.layers import StackedMLP, make_towers
        >>> experts, towers = StackedMLP(4, 8, [16]), make_towers(2, 16, [1])  # 4 experts, 2 tasks
        >>> model = MultiGateMoE(experts, SoftmaxGate(4, num_gates=2), towers)
        >>> preds, aux_loss, members = task_outputs(model, model(torch.randn(5, 8)))
        >>> [tuple(p.shape) for p in preds], members  # one (B, 1) prediction per task
        ([(5, 1), (5, 1)], None)
    """

    preds: list[Tensor]
    """One (B, ...) prediction per task; of a :class:`~dselectk.models.MoEBank`, (B, R): the
    R members' predictions in columns."""
    aux_loss: Tensor | float
    """The model's auxiliary loss (0 when it has none)."""
    members: int | None
    """R for a :class:`~dselectk.models.MoEBank` (each task's loss sums its members'), else None."""


def task_outputs(model: nn.Module, out: Any) -> TaskOutputs:
    """Read the output ``out`` of ``model`` as per-task predictions, for every model family:

    * ``MultiTaskOutput`` (:class:`~dselectk.models.MultiGateMoE`,
      :class:`~dselectk.models.SharedBottom`): one prediction per task;
    * anything with ``output`` and ``aux_loss`` (:class:`~dselectk.models.MoE`'s ``MoEOutput``,
      :class:`~dselectk.layers.SparseMoEFeedForward`'s ``TokenMoEOutput``): one task;
    * a :class:`~dselectk.models.MoEBank`'s (R, T, B) predictions: task t's is (B, R);
    * a plain Tensor: one task, no auxiliary loss (a model whose inner layers have auxiliary
      losses adds them through ``loss_fn``).

    Examples:
        >>> from dselectk import DSelectK, MoEBank
        >>> from dselectk.layers import StackedMLP
        >>> bank = MoEBank(StackedMLP(3 * 4, 8, [4]), DSelectK(4, k=2, num_gates=3 * 2), members=3)
        >>> preds, aux_loss, members = task_outputs(bank, bank(torch.randn(5, 8)))
        >>> [tuple(p.shape) for p in preds], members  # task t: (B, R), R = 3 members
        ([(5, 3), (5, 3)], 3)
        >>> task_outputs(nn.Linear(8, 1), torch.randn(5, 1)).aux_loss  # a tensor: one task
        0.0
    """
    inner = getattr(model, "module", model)  # DistributedDataParallel wraps the model
    if isinstance(inner, MoEBank):
        pred, aux = out[0], out[1]
        return TaskOutputs([p.transpose(0, 1) for p in pred.unbind(1)], aux, inner.members)
    if hasattr(out, "outputs") and hasattr(out, "aux_loss"):
        return TaskOutputs(list(out.outputs), out.aux_loss, None)
    if hasattr(out, "output") and hasattr(out, "aux_loss"):
        return TaskOutputs([out.output], out.aux_loss, None)
    if isinstance(out, Tensor):
        return TaskOutputs([out], 0.0, None)
    raise TypeError(
        f"the model returned {type(out).__name__}; train() and evaluate() read a MultiTaskOutput, "
        f"an output with fields output and aux_loss (MoEOutput, TokenMoEOutput), a MoEBank's "
        f"predictions or a Tensor (one task); for anything else pass loss_fn"
    )


def task_loss(fn: LossFn, pred: Tensor, y: Tensor, members: int | None) -> Tensor:
    """``fn(pred, y)``; of a bank's (B, R) prediction, the sum over its R members."""
    if members is None:
        return fn(pred, y)
    return sum((fn(pred[:, r : r + 1], y) for r in range(members)), pred.new_zeros(()))


def first_member(preds: Sequence[Tensor], members: int | None) -> list[Tensor]:
    """The predictions of one member (what the targets are checked against)."""
    return list(preds) if members is None else [p[:, :1] for p in preds]


def run_losses(
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
    if fns and not any(float(w) > 0 for w in weights):
        raise ValueError(f"task_weights are all 0 ({weights}): no task's loss would train")
    if cfg.early_stopping_patience is not None and val_data is None:
        raise ValueError("early_stopping_patience needs val_data")
    if val_data is not None:
        if not isinstance(val_data, TaskData):
            raise TypeError(f"val_data must be a TaskData, got {type(val_data).__name__}")
        if len(val_data.ys) != num_tasks:
            raise ValueError(
                f"val_data has {len(val_data.ys)} target tensor(s) (ys) but train_data has "
                f"{num_tasks}: one per task in both"
            )
        check_data("val_data", val_data)
    return fns, weights


def loss_names(losses: str | LossFn | Sequence[str | LossFn], num_tasks: int) -> list[str | None]:
    if isinstance(losses, str):
        return [losses] * num_tasks
    if callable(losses):
        return [None] * num_tasks
    return [item if isinstance(item, str) else None for item in losses]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: TaskData,
    losses: str | LossFn | Sequence[str | LossFn],
    batch_size: int = 4096,
) -> dict[str, list[float]]:
    """Mean loss of each task over ``data`` (model in eval mode), and accuracy for "ce"/"bce".

    The targets of the named losses are checked against the model's outputs (as :func:`train`
    does); of a :class:`~dselectk.models.MoEBank`, a task's loss is its members' mean.

    Returns:
        ``{"loss": [...], "accuracy": [...]}`` (accuracy is NaN for regression tasks).

    Examples:
        >>> from dselectk import MultiGateMoE, SoftmaxGate
        >>> from dselectk.layers import StackedMLP, make_towers
        >>> experts, towers = StackedMLP(4, 8, [16]), make_towers(2, 16, [1])  # 4 experts, 2 tasks
        >>> model = MultiGateMoE(experts, SoftmaxGate(4, num_gates=2), towers)
        >>> x = torch.randn(32, 8)
        >>> data = TaskData(x, [x[:, :1], (x[:, 1:2] > 0).float()])  # regression, binary
        >>> metrics = evaluate(model, data, ["mse", "bce"])
        >>> loss, accuracy = metrics["loss"], metrics["accuracy"]  # one entry per task
        >>> len(loss), math.isnan(accuracy[0]), 0.0 <= accuracy[1] <= 1.0  # NaN: regression
        (2, True, True)
    """
    if not isinstance(data, TaskData):
        raise TypeError(f"data must be a TaskData, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError(f"data has no examples (x has shape {tuple(data.x.shape)})")
    fns = _resolve_losses(losses, len(data.ys))
    kinds = loss_names(losses, len(fns))
    was_training = model.training
    model.eval()
    sums = [0.0] * len(fns)
    correct = [0.0] * len(fns)
    for start in range(0, len(data), batch_size):
        idx = torch.arange(start, min(start + batch_size, len(data)))
        batch = data.batch(idx)
        preds, _, members = task_outputs(model, model(batch.x))
        if len(preds) != len(fns):
            raise ValueError(f"model has {len(preds)} task outputs but {len(fns)} losses")
        if start == 0:
            check_targets(kinds, first_member(preds, members), batch.ys)
        for t, (fn, pred, y) in enumerate(zip(fns, preds, batch.ys)):
            loss = task_loss(fn, pred, y, members) / (members or 1)
            sums[t] += float(loss) * len(idx)
            if members is not None:
                pred = pred.mean(1, keepdim=True)  # accuracy of the members' mean prediction
            if kinds[t] == "ce":
                correct[t] += float((pred.argmax(-1) == y).sum())
            elif kinds[t] == "bce":
                correct[t] += float(((pred.reshape(y.shape) > 0) == (y > 0.5)).sum())
            else:
                correct[t] = math.nan
    model.train(was_training)
    n = len(data)
    return {"loss": [s / n for s in sums], "accuracy": [c / n for c in correct]}
