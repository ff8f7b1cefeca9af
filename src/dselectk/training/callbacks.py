"""The hooks of :func:`~dselectk.training.train`: :class:`Callback` (after every step, every
epoch, at the end) and :class:`GateRecorder`, which records the gate weights on a probe batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from dselectk.gates.base import Gate, check_positive_int
from dselectk.training.state import History

if TYPE_CHECKING:
    from dselectk.training.tasks import TaskData

__all__ = ["Callback", "GateRecorder"]


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


def step_hooks(callbacks: Sequence[Any]) -> list[Callable[..., None]]:
    hooks: list[Callable[..., None]] = []
    for cb in callbacks:
        if isinstance(cb, Callback):
            hooks.append(cb.on_step)
        elif callable(cb):
            hooks.append(lambda model, batch, out, hist, f=cb: f(model, hist))
        else:
            raise TypeError(f"callbacks must be Callback objects or callables, got {cb!r}")
    return hooks
