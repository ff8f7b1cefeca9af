"""Multi-task data and losses: :class:`TaskData` (inputs shared by the tasks, one target tensor
per task), the named per-task losses (:data:`LOSSES`) and :func:`evaluate`. The training loop
(:mod:`dselectk.training`) re-exports all three."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LOSSES", "LossFn", "TaskData", "evaluate"]

LossFn = Callable[[Tensor, Tensor], Tensor]


def _mse(pred: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(pred.reshape(y.shape), y)


def _bce(pred: Tensor, y: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(pred.reshape(y.shape), y.to(pred.dtype))


LOSSES: dict[str, LossFn] = {"mse": _mse, "bce": _bce, "ce": F.cross_entropy}
"""Named per-task losses: mean squared error, binary cross-entropy on logits, cross-entropy."""


@dataclass
class TaskData:
    """Inputs shared by all tasks and one target tensor per task (first dim: examples)."""

    x: Tensor
    ys: list[Tensor]

    def __post_init__(self) -> None:
        if not self.ys:
            raise ValueError("ys must hold one target tensor per task")
        n = self.x.shape[0]
        for i, y in enumerate(self.ys):
            if y.shape[0] != n:
                raise ValueError(f"ys[{i}] has {y.shape[0]} rows but x has {n}")

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def batch(self, idx: Tensor) -> TaskData:
        return TaskData(self.x[idx], [y[idx] for y in self.ys])


def _resolve_losses(losses: str | LossFn | Sequence[str | LossFn], num_tasks: int) -> list[LossFn]:
    items = [losses] * num_tasks if isinstance(losses, str) or callable(losses) else list(losses)
    if len(items) != num_tasks:
        raise ValueError(f"losses must name one loss per task ({num_tasks}), got {len(items)}")
    out = []
    for item in items:
        if isinstance(item, str):
            if item not in LOSSES:
                raise ValueError(f"unknown loss {item!r}; expected one of {sorted(LOSSES)}")
            out.append(LOSSES[item])
        else:
            out.append(item)
    return out


def _task_losses(model: nn.Module, data: TaskData, fns: list[LossFn]) -> tuple[list[Tensor], Any]:
    out = model(data.x)
    if len(out.outputs) != len(fns):
        raise ValueError(f"model has {len(out.outputs)} task outputs but {len(fns)} losses")
    return [fn(p, y) for fn, p, y in zip(fns, out.outputs, data.ys)], out


def _loss_names(losses: str | LossFn | Sequence[str | LossFn], num_tasks: int) -> list[str | None]:
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

    Returns:
        ``{"loss": [...], "accuracy": [...]}`` (accuracy is NaN for regression tasks).
    """
    fns = _resolve_losses(losses, len(data.ys))
    kinds = _loss_names(losses, len(fns))
    was_training = model.training
    model.eval()
    sums = [0.0] * len(fns)
    correct = [0.0] * len(fns)
    for start in range(0, len(data), batch_size):
        idx = torch.arange(start, min(start + batch_size, len(data)))
        batch = data.batch(idx)
        task_losses, out = _task_losses(model, batch, fns)
        for t, (loss, pred, y) in enumerate(zip(task_losses, out.outputs, batch.ys)):
            sums[t] += float(loss) * len(idx)
            if kinds[t] == "ce":
                correct[t] += float((pred.argmax(-1) == y).sum())
            elif kinds[t] == "bce":
                correct[t] += float(((pred.reshape(y.shape) > 0) == (y > 0.5)).sum())
            else:
                correct[t] = math.nan
    model.train(was_training)
    n = len(data)
    return {"loss": [s / n for s in sums], "accuracy": [c / n for c in correct]}
