"""Schedules for gate hyperparameters (γ, λ, temperature), stepped by the training loop.

A :class:`Schedule` maps a step count to a value; an :class:`AttributeScheduler` writes that
value into an attribute (e.g. ``gamma``) of one or more modules each time the training loop calls
:meth:`AttributeScheduler.step`. Gates keep no hidden step counters: the scheduler is the only
state, and it has a ``state_dict`` so an interrupted run resumes where it was.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from torch import nn

from dselectk.gates.base import check_positive_int

__all__ = [
    "AttributeScheduler",
    "ConstantSchedule",
    "GeometricSchedule",
    "LinearSchedule",
    "Schedule",
    "WarmupSchedule",
]


class Schedule:
    """A value as a function of the step (0-based)."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError


class ConstantSchedule(Schedule):
    """Always ``value``."""

    def __init__(self, value: float) -> None:
        self.value = float(value)

    def __call__(self, step: int) -> float:
        return self.value


class LinearSchedule(Schedule):
    """Linear from ``start`` (step 0) to ``end`` (step ``steps``), then constant."""

    def __init__(self, start: float, end: float, steps: int) -> None:
        self.start, self.end = float(start), float(end)
        self.steps = check_positive_int("steps", steps)

    def __call__(self, step: int) -> float:
        t = min(max(step, 0), self.steps) / self.steps
        return self.start + t * (self.end - self.start)


class GeometricSchedule(Schedule):
    """Evenly spaced on a log scale from ``start`` to ``end`` over ``steps`` steps.

    The temperature annealing of the paper's "Ablation (Annealing)" gate (Appendix D: from s down
    to 1e-16), and a natural γ anneal towards 0 (Section 3.2).
    """

    def __init__(self, start: float, end: float, steps: int) -> None:
        if not (start > 0 and end > 0):
            raise ValueError(
                f"start and end must be > 0 for a log-scale schedule, got {start}, {end}"
            )
        self.start, self.end = float(start), float(end)
        self.steps = check_positive_int("steps", steps)

    def __call__(self, step: int) -> float:
        t = min(max(step, 0), self.steps) / self.steps
        return math.exp(math.log(self.start) + t * (math.log(self.end) - math.log(self.start)))


class WarmupSchedule(Schedule):
    """0 for ``delay`` steps, then ``inner`` shifted by ``delay`` (e.g. start λ after warm-up)."""

    def __init__(self, inner: Schedule, delay: int) -> None:
        self.inner = inner
        self.delay = check_positive_int("delay", delay, 0)

    def __call__(self, step: int) -> float:
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
    def value(self) -> float:
        """The current value."""
        return self.schedule(self.last_step)

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = int(state["last_step"])
        self._apply()
