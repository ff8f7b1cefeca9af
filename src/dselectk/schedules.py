"""Schedules for gate hyperparameters (γ, λ, temperature), stepped by the training loop.

A :class:`Schedule` maps a step count to a value; an :class:`AttributeScheduler` writes that
value into an attribute (e.g. ``gamma``) of one or more modules each time the training loop calls
:meth:`AttributeScheduler.step`. Gates keep no hidden step counters: the scheduler is the only
state, and it has a ``state_dict`` so an interrupted run resumes where it was.

**Per-member schedules.** :class:`LinearSchedule` and :class:`GeometricSchedule` also take
tensors for their start, end and length: the schedule then returns one value per element, e.g.
one temperature per gate of a bank whose members anneal from different start values over
different run lengths (the vectorized grid search trains such members together). The value is
written into a per-gate hyperparameter of the gate (see
:class:`~dselectk.gates.base.HyperParameter`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from dselectk.gates.base import check_positive_int

__all__ = [
    "AttributeScheduler",
    "ConstantSchedule",
    "GeometricSchedule",
    "LinearSchedule",
    "Schedule",
    "WarmupSchedule",
]


def _members(value: float | Tensor) -> Tensor | None:
    """``value`` as a float64 tensor when it is a tensor (per-member), else None."""
    return value.detach().to(torch.float64) if isinstance(value, Tensor) else None


class Schedule:
    """A value as a function of the step (0-based)."""

    def __call__(self, step: int) -> Any:
        raise NotImplementedError


class ConstantSchedule(Schedule):
    """Always ``value``."""

    def __init__(self, value: float) -> None:
        self.value = float(value)

    def __call__(self, step: int) -> float:
        return self.value


class LinearSchedule(Schedule):
    """Linear from ``start`` (step 0) to ``end`` (step ``steps``), then constant.

    ``start`` and ``end`` may be tensors (one value per member; float64 tensor values).
    """

    def __init__(self, start: float | Tensor, end: float | Tensor, steps: int) -> None:
        ts, te = _members(start), _members(end)
        self.start: Any = ts if ts is not None else float(start)
        self.end: Any = te if te is not None else float(end)
        self.steps = check_positive_int("steps", steps)

    def __call__(self, step: int) -> Any:
        t = min(max(step, 0), self.steps) / self.steps
        return self.start + t * (self.end - self.start)


class GeometricSchedule(Schedule):
    """Evenly spaced on a log scale from ``start`` to ``end`` over ``steps`` steps.

    The temperature annealing of the paper's "Ablation (Annealing)" gate (Appendix D: from s down
    to 1e-16), and a natural γ anneal towards 0 (Section 3.2).

    Per member: ``start`` (and ``steps``) may be tensors, one value per member, so that member
    i anneals from ``start[i]`` to ``end`` over its own ``steps[i]`` steps (float64 values).

    Args:
        start, end: > 0.
        steps: >= 1 (an int, or a tensor of member lengths).
    """

    def __init__(self, start: float | Tensor, end: float, steps: int | Tensor) -> None:
        ts, tn = _members(start), _members(steps)
        if ts is None and tn is None:
            if not (start > 0 and end > 0):
                raise ValueError(
                    f"start and end must be > 0 for a log-scale schedule, got {start}, {end}"
                )
            self.start: Any = float(start)
            self.steps: Any = check_positive_int("steps", steps)
        else:
            first = ts if ts is not None else tn
            assert first is not None
            self.start = ts if ts is not None else torch.full_like(first, float(start))
            self.steps = tn if tn is not None else torch.full_like(first, float(steps))
            if not (bool((self.start > 0).all()) and end > 0):
                raise ValueError(f"start and end must be > 0 for a log-scale schedule, got {end}")
            if not bool((self.steps >= 1).all()):
                raise ValueError(f"steps must be >= 1 for every member, got {self.steps.tolist()}")
        self.end = float(end)

    def __call__(self, step: int) -> Any:
        if isinstance(self.start, Tensor):
            t = torch.clamp(max(step, 0) / self.steps, max=1.0)
            log_start = torch.log(self.start)
            return torch.exp(log_start + t * (math.log(self.end) - log_start))
        t = min(max(step, 0), self.steps) / self.steps
        return math.exp(math.log(self.start) + t * (math.log(self.end) - math.log(self.start)))


class WarmupSchedule(Schedule):
    """0 for ``delay`` steps, then ``inner`` shifted by ``delay`` (e.g. start λ after warm-up)."""

    def __init__(self, inner: Schedule, delay: int) -> None:
        self.inner = inner
        self.delay = check_positive_int("delay", delay, 0)

    def __call__(self, step: int) -> Any:
        return 0.0 if step < self.delay else self.inner(step - self.delay)


class AttributeScheduler:
    """Sets ``attribute`` of ``modules`` to ``schedule(step)``.

    Call :meth:`step` once per training step (after the optimizer step); the value for step 0
    is applied at construction.

    Args:
        modules: the modules (e.g. gates) to update; each must have a settable ``attribute``.
        attribute: e.g. "gamma", "entropy_reg", "temperature".
        schedule: the schedule.
    """

    def __init__(
        self, modules: nn.Module | Iterable[nn.Module], attribute: str, schedule: Schedule
    ) -> None:
        self.modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        if not self.modules:
            raise ValueError("modules must name at least one module")
        for m in self.modules:
            if not hasattr(m, attribute):
                raise ValueError(f"{type(m).__name__} has no attribute {attribute!r} to schedule")
        self.attribute = attribute
        self.schedule = schedule
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        value = self.schedule(self.last_step)
        for m in self.modules:
            setattr(m, self.attribute, value)

    def step(self) -> None:
        """Advance one step and write the new value."""
        self.last_step += 1
        self._apply()

    @property
    def value(self) -> Any:
        """The current value."""
        return self.schedule(self.last_step)

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = int(state["last_step"])
        self._apply()
