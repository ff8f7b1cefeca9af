"""Schedules for gate hyperparameters (γ, λ, temperature), stepped by the training loop.

One vocabulary describes every schedule: a :class:`Ramp`. The value is held for a while, then
moves linearly or geometrically (evenly on a log scale) from a start to an end, then stays
there; the hold and the move are fractions of the run's optimizer steps (``delay``, ``span``) or
counts of steps (``delay_steps``, ``span_steps``). :meth:`Ramp.scheduler` binds a ramp to the
modules whose attribute it sets and returns an :class:`AttributeScheduler`, which
:func:`~dselectk.training.train` steps after every optimizer step (``schedulers=[...]``)::

    steps = total_steps(config.epochs, len(data), config.batch_size)
    anneal = Ramp("gamma", end_factor=1e-3, shape="geometric").scheduler(gates, steps)
    train(model, data, "mse", config, schedulers=[anneal])

Gates keep no hidden step counters: the scheduler is the only state, and it has a
``state_dict`` so an interrupted run resumes where it was (checkpoints of ``train`` keep it).
A :class:`~dselectk.variants.Variant` holds its ramps (``schedules=(Ramp(...), ...)``) and builds
their schedulers for a study's runs.

**Per-member schedules.** A ramp whose start is a tensor (the per-gate values of a bank, one
per member of a vectorized grid search) returns one value per element; the value is written into
a per-gate hyperparameter of the gate (see :class:`~dselectk.gates.base.HyperParameter`).

The curves a ramp compiles to (:class:`LinearSchedule`, :class:`GeometricSchedule`,
:class:`DelayedSchedule`, :class:`ConstantSchedule`, all :class:`Schedule`: a value as a function
of the step) are the implementation, not the vocabulary: they are importable, but describe a
schedule with a :class:`Ramp`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Real
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dselectk.gates.base import check_positive_int

__all__ = ["AttributeScheduler", "Ramp", "total_steps"]


def _members(value: float | Tensor) -> Tensor | None:
    """``value`` as a float64 tensor when it is a tensor (per-member), else None."""
    return value.detach().to(torch.float64) if isinstance(value, Tensor) else None


def _finite(name: str, value: Any) -> None:
    """A ValueError naming ``name`` unless ``value`` (a number or a tensor) is finite."""
    if isinstance(value, Tensor):
        if value.numel() == 0:
            raise ValueError(f"{name} must hold at least one value, got an empty tensor")
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name} must be finite, got {value.tolist()}")
        return
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


class Schedule:
    """A value as a function of the step (0-based)."""

    def __call__(self, step: int) -> Any:
        raise NotImplementedError


class ConstantSchedule(Schedule):
    """Always ``value`` (finite)."""

    def __init__(self, value: float) -> None:
        _finite("value", value)
        self.value = float(value)

    def __call__(self, step: int) -> float:
        return self.value


class LinearSchedule(Schedule):
    """Linear from ``start`` (step 0) to ``end`` (step ``steps``), then constant.

    ``start`` and ``end`` may be tensors (one value per member; float64 tensor values); both
    finite, ``steps`` >= 1.
    """

    def __init__(self, start: float | Tensor, end: float | Tensor, steps: int) -> None:
        _finite("start", start)
        _finite("end", end)
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
        start, end: finite, > 0.
        steps: >= 1 (an int, or a tensor of member lengths).
    """

    def __init__(self, start: float | Tensor, end: float, steps: int | Tensor) -> None:
        _finite("start", start)
        _finite("end", end)
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


class DelayedSchedule(Schedule):
    """``before`` for the first ``delay`` steps, then ``inner`` shifted by ``delay`` (e.g. λ = 0
    during a warm-up, or γ held at its start before an anneal)."""

    def __init__(self, inner: Schedule, delay: int, before: Any = 0.0) -> None:
        if not callable(inner):
            raise TypeError(f"inner must be a Schedule, got {type(inner).__name__}")
        _finite("before", before)
        self.inner = inner
        self.delay = check_positive_int("delay", delay, 0)
        self.before = before

    def __call__(self, step: int) -> Any:
        return self.before if step < self.delay else self.inner(step - self.delay)


class AttributeScheduler:
    """Sets ``attribute`` of ``modules`` to ``schedule(step)``: what ``train(schedulers=...)``
    steps. Build it with :meth:`Ramp.scheduler`.

    Call :meth:`step` once per training step (after the optimizer step); the value for step 0
    is applied at construction. :meth:`state_dict` / :meth:`load_state_dict` carry the step
    count (checkpoints of :func:`~dselectk.training.train` keep it).

    Args:
        modules: the modules (e.g. gates) to update; each must have a settable ``attribute``.
        attribute: e.g. "gamma", "entropy_reg", "temperature".
        schedule: the value as a function of the step (what :meth:`Ramp.schedule` returns).

    Examples:
        >>> from dselectk.gates import DSelectK
        >>> gate = DSelectK(num_experts=4, k=2, gamma=1.0)
        >>> s = Ramp("gamma", end=0.5).scheduler(gate, total_steps=4)  # an AttributeScheduler
        >>> for _ in range(2):
        ...     s.step()
        >>> s.last_step, gate.gamma, s.state_dict()
        (2, 0.75, {'last_step': 2})
    """

    def __init__(
        self, modules: nn.Module | Iterable[nn.Module], attribute: str, schedule: Schedule
    ) -> None:
        self.modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        if not self.modules:
            raise ValueError("modules must name at least one module")
        if not isinstance(attribute, str) or not attribute:
            raise ValueError(f"attribute must be a non-empty string, got {attribute!r}")
        if not callable(schedule):
            raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
        for m in self.modules:
            if not isinstance(m, nn.Module):
                raise TypeError(f"modules must be torch modules, got {type(m).__name__}")
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
        """The step count (what a checkpoint keeps)."""
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved step and write its value."""
        self.last_step = int(state["last_step"])
        self._apply()


@dataclass(frozen=True)
class Ramp:
    """How one hyperparameter moves during training: held, then moved, then kept.

    The value is ``before`` during the delay (``delay`` of the run's optimizer steps, or
    ``delay_steps`` steps), then moves from ``start`` to ``end`` over the span (``span`` of the
    steps, or ``span_steps`` steps; default: the rest of the run) linearly or evenly on a log
    scale, then stays at ``end``. Checked when it is built: finite values, fractions in range,
    positive lengths, a geometric ramp's values > 0.

    Attributes:
        param: the hyperparameter (``gamma``, ``entropy_reg``, ``temperature``, ...).
        start: the first value; None: the run's own value (see :meth:`scheduler`).
        end: the last value; None: the run's own value.
        end_factor: the last value as a multiple of ``start`` (instead of ``end``).
        delay: the fraction of the steps before the move, in [0, 1).
        span: the fraction of the steps the move takes, in (0, 1]; None: the rest of the run.
        shape: ``"linear"`` or ``"geometric"``.
        before: the value during the delay; None: ``start``.
        delay_steps: the delay as a number of steps (>= 0), instead of ``delay``.
        span_steps: the move's length in steps (>= 1), instead of ``span``.

    Examples:
        >>> ramp = Ramp("entropy_reg", end=0.1, delay=0.5, before=0.0)  # λ off, then 0 → 0.1
        >>> s = ramp.schedule(0.0, total_steps=100)  # the curve of a 100-step run
        >>> s(0), s(49), s(75), s(100)
        (0.0, 0.0, 0.05, 0.1)
        >>> anneal = Ramp("gamma", end_factor=1e-2, span_steps=10, shape="geometric")
        >>> [round(anneal.schedule(1.0)(t), 4) for t in (0, 5, 10, 20)]  # no run length needed
        [1.0, 0.1, 0.01, 0.01]
    """

    param: str
    start: float | None = None
    end: float | None = None
    end_factor: float | None = None
    delay: float = 0.0
    span: float | None = None
    shape: Literal["linear", "geometric"] = "linear"
    before: float | None = None
    delay_steps: int | None = None
    span_steps: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.param, str) or not self.param:
            raise ValueError(f"Ramp.param must be a non-empty string, got {self.param!r}")
        if self.shape not in ("linear", "geometric"):
            raise ValueError(f"Ramp.shape must be 'linear' or 'geometric', got {self.shape!r}")
        if self.end is not None and self.end_factor is not None:
            raise ValueError("Ramp: give end or end_factor, not both")
        for name in ("start", "end", "end_factor", "before"):
            value = getattr(self, name)
            if value is not None:
                _finite(f"Ramp.{name}", value)
        if self.shape == "geometric":
            for name in ("start", "end", "end_factor"):
                value = getattr(self, name)
                if value is not None and not value > 0:
                    raise ValueError(f"Ramp.{name} must be > 0 for a geometric ramp, got {value}")
        if isinstance(self.delay, bool) or not (
            isinstance(self.delay, (int, float)) and 0.0 <= self.delay < 1.0
        ):
            raise ValueError(f"Ramp.delay must be in [0, 1), got {self.delay}")
        if self.span is not None and (
            isinstance(self.span, bool)
            or not (isinstance(self.span, (int, float)) and 0.0 < self.span <= 1.0)
        ):
            raise ValueError(f"Ramp.span must be in (0, 1], got {self.span}")
        if self.delay_steps is not None:
            if self.delay:
                raise ValueError("Ramp: give delay or delay_steps, not both")
            check_positive_int("Ramp.delay_steps", self.delay_steps, 0)
        if self.span_steps is not None:
            if self.span is not None:
                raise ValueError("Ramp: give span or span_steps, not both")
            check_positive_int("Ramp.span_steps", self.span_steps)

    def _lengths(self, total_steps: int | None) -> tuple[int, int]:
        """(steps of the delay, steps of the move) in a run of ``total_steps``."""
        needs_total = (self.delay and self.delay_steps is None) or self.span_steps is None
        if total_steps is None:
            if needs_total:
                raise ValueError(
                    f"{self}: total_steps is needed (the delay or the span is a fraction of the "
                    "run, or the move lasts the rest of it); give it, or delay_steps/span_steps"
                )
        else:
            check_positive_int("total_steps", total_steps, 0)
        if self.delay_steps is not None:
            delay = self.delay_steps
        else:
            delay = int(self.delay * total_steps) if total_steps is not None else 0
        if self.span_steps is not None:
            steps = self.span_steps
        else:
            assert total_steps is not None
            steps = total_steps - delay if self.span is None else int(self.span * total_steps)
        return delay, max(1, steps)

    def schedule(self, value: float | Tensor, total_steps: int | None = None) -> Schedule:
        """The curve for a run whose own value is ``value`` (used where ``start`` or ``end`` is
        None) and that takes ``total_steps`` optimizer steps (None: a ramp given in steps)."""
        start = value if self.start is None else self.start
        if self.end_factor is not None:
            end: Any = start * self.end_factor
        else:
            end = value if self.end is None else self.end
        delay, steps = self._lengths(total_steps)
        inner: Schedule
        if self.shape == "geometric":
            inner = GeometricSchedule(start, float(end), steps)
        else:
            inner = LinearSchedule(start, end, steps)
        if delay == 0:
            return inner
        return DelayedSchedule(inner, delay, start if self.before is None else self.before)

    def scheduler(
        self,
        modules: nn.Module | Iterable[nn.Module],
        total_steps: int | None = None,
        *,
        value: float | Tensor | None = None,
    ) -> AttributeScheduler:
        """The scheduler that applies this ramp to ``modules`` (pass it to
        ``train(schedulers=[...])``).

        Args:
            modules: the module(s) whose ``param`` it sets, e.g. a gate or a model's gates.
            total_steps: the run's optimizer steps (:func:`total_steps`); None for a ramp
                given in steps (``span_steps``, and ``delay_steps`` or no delay).
            value: the run's own value, used where ``start`` or ``end`` is None; default: the
                first module's current ``param``.
        """
        mods = [modules] if isinstance(modules, nn.Module) else list(modules)
        if not mods:
            raise ValueError("modules must name at least one module")
        if value is None:
            if not hasattr(mods[0], self.param):
                raise ValueError(
                    f"{type(mods[0]).__name__} has no attribute {self.param!r} to schedule"
                )
            value = getattr(mods[0], self.param)
        return AttributeScheduler(mods, self.param, self.schedule(value, total_steps))


def total_steps(epochs: int, examples: int, batch_size: int) -> int:
    """Optimizer steps of a run (what a ramp's and a search plan's fractions are of): ``epochs``
    passes over ``examples`` in batches of ``batch_size`` (the last one partial). Under DDP,
    ``examples`` is one process's shard.

    Examples:
        >>> total_steps(epochs=3, examples=1000, batch_size=128)  # 8 batches per epoch
        24
    """
    check_positive_int("epochs", epochs, 0)
    check_positive_int("examples", examples, 0)
    check_positive_int("batch_size", batch_size)
    return epochs * math.ceil(examples / batch_size)
