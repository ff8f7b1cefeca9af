"""Training measurements of a multi-gate MoE: gate convergence and expert FLOPs (Table C.2).

The :class:`GateMonitor` callback of :func:`~dselectk.training.train` measures:

* **steps until S(Z) is binary**: every ``check_every`` steps the binarizing gates' smooth-step
  outputs (DSelect-k's S(Z); per-example: S(Wx) of every example of the step's batch) are
  checked *as they were when the step started* (the monitor keeps a copy of the gates, and of
  the model's ``bottom`` for per-example gates, from the end of the previous step). The first
  checked step at which all are exactly 0 or 1 is reported as a percentage of the run's
  training steps (an upper bound, by at most ``check_every`` steps).
* **expert FLOPs during training**: at every step, the experts each example needs are counted
  from that step's gate weights: an expert is needed for an example if some task's gate gives
  it a nonzero weight (static gates: the union over tasks; per-example gates: per example).
  With ``F`` the forward FLOPs of one expert on one example (backward ≈ 2 × forward), a run
  costs ``3 F Σ_steps Σ_examples needed(step, example)`` (:func:`training_expert_flops`); the
  DSelect-k / Top-k ratio (:func:`flops_ratio`) divides these totals (means over runs). Gates,
  towers and the bottom are not counted. :class:`~dselectk.models.MultiGateMoE` skips exactly
  the experts no weight uses, batch-wide.

:func:`gate_summary` and :func:`gate_metrics` measure the trained gates (mean weights, selected
experts). :class:`StepTimer` measures the wall time per optimizer step after a warm-up;
:class:`GateTrajectory` records chosen rows of a gate bank's weights along a run.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dselectk.gates import Gate
from dselectk.training import Callback, History, TaskData

__all__ = [
    "GateMonitor",
    "GateTrajectory",
    "StepTimer",
    "binary_fractions",
    "flops_ratio",
    "gate_metrics",
    "gate_summary",
    "training_expert_flops",
]


def _subsample(steps: Sequence[int], values: Sequence[Any], limit: int) -> tuple[list, list]:
    if len(steps) <= limit:
        return list(steps), list(values)
    idx = np.unique(np.linspace(0, len(steps) - 1, limit).round().astype(int))
    return [steps[i] for i in idx], [values[i] for i in idx]


class GateMonitor(Callback):
    """Measures gate convergence and experts needed from the training steps (module docstring).

    After every step it counts the experts needed per example from the step's gate weights;
    every ``check_every`` steps (and at step 1) it checks whether the binarizing gates' S(Z) was
    binary when the step started; every ``record_every`` steps (0: never) it records the step's
    gate weights (per-example: mean over the batch), a trajectory without an extra forward pass.

    Args:
        model: a :class:`~dselectk.models.MultiGateMoE` or
            :class:`~dselectk.models.SharedBottom`, before training.
        check_every: steps between two binary checks.
        record_every: steps between two recorded gate weights (0: none).
    """

    def __init__(self, model: nn.Module, *, check_every: int = 10, record_every: int = 0) -> None:
        self.check_every = max(1, int(check_every))
        self.record_every = int(record_every)
        self.examples = 0
        self.needed_sum = 0.0
        """Σ_steps Σ_examples experts needed."""
        self.needed_per_step: list[float] = []
        self.batch_sizes: list[int] = []
        self.binary_checks: list[tuple[int, float]] = []
        self.first_binary_step: int | None = None
        self.first_binary_step_task: dict[int, int] = {}
        """Per task gate: first checked step at which its S(Z) (all examples) was binary."""
        self.recorded_steps: list[int] = []
        self.recorded_weights: list[Tensor] = []
        self.gates = [m for m in model.modules() if isinstance(m, Gate) and m.binarizes]
        per_example = any(not g.static for g in self.gates)
        self.bottom: nn.Module | None = getattr(model, "bottom", None) if per_example else None
        self._before = self._snapshot()  # the gates as step 1 starts

    def _snapshot(self) -> tuple[list[Gate], nn.Module | None] | None:
        if not self.gates:
            return None
        return copy.deepcopy((self.gates, self.bottom))

    def _checked(self, step: int) -> bool:
        return step == 1 or step % self.check_every == 0

    @torch.no_grad()
    def on_step(self, model: nn.Module, batch: TaskData, out: Any, history: History) -> None:
        """Count the step's needed experts, record its weights, check the gates' binarity."""
        step, b = history.steps, len(batch)
        self.examples += b
        w = getattr(out, "gate_weights", None)
        if w is not None:
            nz = w != 0
            if nz.dim() == 2:  # static (T, n): same experts for every example
                per_example = float(nz.any(dim=0).sum())
            else:  # (B, T, n)
                per_example = float(nz.any(dim=1).sum(dim=-1).float().mean())
            self.needed_per_step.append(per_example)
            self.batch_sizes.append(b)
            self.needed_sum += per_example * b
            if self.record_every and (step == 1 or step % self.record_every == 0):
                mean_w = w.detach() if w.dim() == 2 else w.detach().mean(dim=0)
                self.recorded_steps.append(step)
                self.recorded_weights.append(mean_w.float().cpu().clone())
        if self._before is not None and self._checked(step):
            per_task = binary_fractions(*self._before, batch.x)
            frac = min(per_task)
            self.binary_checks.append((step, frac))
            if frac >= 1.0 and self.first_binary_step is None:
                self.first_binary_step = step
            for t, f in enumerate(per_task):
                if f >= 1.0 and t not in self.first_binary_step_task:
                    self.first_binary_step_task[t] = step
        if self._before is not None and self._checked(step + 1):
            self._before = self._snapshot()

    def binary_fraction(self, x: Tensor) -> float:
        """Smallest fraction, over the binarizing gates and tasks, of binary S(Z) (or S(Wx) on
        the examples of ``x``), as the gates are now."""
        return min(binary_fractions(self.gates, self.bottom, x))

    def results(
        self, steps: int, n_tasks: int, expert_flops: float, trajectory: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(metrics, extras) of a run of ``steps`` steps: experts needed and training FLOPs
        (``expert_flops``: F), binarity (overall and per task), the binary checks and, with
        ``trajectory``, the recorded gate weights."""
        metrics: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        if self.needed_per_step:
            metrics["train_expert_flops"] = training_expert_flops(
                self.needed_per_step, self.batch_sizes, expert_flops
            )
            metrics["mean_experts_needed"] = self.needed_sum / max(1, self.examples)
            metrics["expert_forward_flops"] = expert_flops
        if self.gates:
            b = self.first_binary_step
            metrics["binary_reached"] = 0.0 if b is None else 1.0
            if b is not None:
                metrics["steps_until_binary"] = b
                metrics["pct_steps_until_binary"] = 100.0 * b / max(1, steps)
            metrics["final_binary_fraction"] = self.binary_checks[-1][1]
            for t in range(n_tasks):
                bt = self.first_binary_step_task.get(t)
                metrics[f"binary_reached_task{t + 1}"] = 0.0 if bt is None else 1.0
                if bt is not None:
                    metrics[f"pct_steps_until_binary_task{t + 1}"] = 100.0 * bt / max(1, steps)
            checks = self.binary_checks
            cs, cv = _subsample([c[0] for c in checks], [c[1] for c in checks], 200)
            extra["binary_checks"] = {"steps": cs, "fraction": [round(v, 4) for v in cv]}
        if trajectory and self.recorded_steps:
            ss, ws = _subsample(self.recorded_steps, self.recorded_weights, 120)
            extra["trajectory"] = {
                "steps": ss,
                "weights": [
                    [[round(float(v), 4) for v in row] for row in w.reshape(-1, w.shape[-1])]
                    for w in ws
                ],
            }
        return metrics, extra


class StepTimer(Callback):
    """Wall time per optimizer step, the first ``warmup`` steps left out (allocations, caches,
    compiled kernels): the clock starts after step ``warmup`` (:attr:`History.steps`) and
    :meth:`per_step` divides the time since by the steps taken since."""

    def __init__(self, warmup: int = 10) -> None:
        self.warmup = warmup
        self.t0: float | None = None
        self.steps = 0

    def on_step(self, model: nn.Module, batch: TaskData, out: Any, history: History) -> None:
        if history.steps == self.warmup:
            self.t0, self.steps = time.perf_counter(), 0
        elif self.t0 is not None:
            self.steps += 1

    def per_step(self) -> float:
        """Seconds per step after the warm-up; NaN before a timed step."""
        return (time.perf_counter() - self.t0) / self.steps if self.t0 and self.steps else math.nan


class GateTrajectory(Callback):
    """The weights (:meth:`~dselectk.gates.base.Gate.expert_weights`) of the gates ``rows`` of
    a bank, rounded to ``digits``, at step 0 (when created) and every ``every`` steps:
    ``trajectories[row] = {"steps": [...], "weights": [[w_1, ..., w_E], ...]}``."""

    def __init__(self, gate: Gate, rows: Sequence[int], every: int, digits: int = 5) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.gate, self.every, self.digits = gate, every, digits
        self.trajectories: dict[int, dict[str, Any]] = {
            r: {"steps": [], "weights": []} for r in rows
        }
        self.record(0)

    def on_step(self, model: nn.Module, batch: TaskData, out: Any, history: History) -> None:
        if history.steps % self.every == 0:
            self.record(history.steps)

    @torch.no_grad()
    def record(self, step: int) -> None:
        """Record the rows' weights now, as those of ``step``."""
        if self.trajectories:
            w = self.gate.expert_weights()
            for r, tr in self.trajectories.items():
                tr["steps"].append(step)
                tr["weights"].append([round(float(v), self.digits) for v in w[r]])


@torch.no_grad()
def binary_fractions(gates: Sequence[Gate], bottom: nn.Module | None, x: Tensor) -> list[float]:
    """Per task gate (of every gate in ``gates``): binary S(Z) (1/0), or per-example the
    fraction of the examples of ``x`` (through ``bottom``, if any) whose S(Wx) is binary."""
    h = x if bottom is None else bottom(x)
    fracs: list[float] = []
    for g in gates:
        r = g.is_binary(None if g.static else h)
        fracs.extend(float(v) for v in r.float().reshape(-1))
    return fracs


def training_expert_flops(
    needed_per_example: Sequence[float], batch_sizes: Sequence[int], expert_forward_flops: float
) -> float:
    """Expert FLOPs of a training run: 3 F Σ_s needed_s · B_s (forward + backward ≈ 3× forward).

    Args:
        needed_per_example: mean number of experts needed per example at each step.
        batch_sizes: examples of each step.
        expert_forward_flops: F, forward FLOPs of one expert on one example.
    """
    if len(needed_per_example) != len(batch_sizes):
        raise ValueError("needed_per_example and batch_sizes must have one entry per step")
    return 3.0 * expert_forward_flops * sum(n * b for n, b in zip(needed_per_example, batch_sizes))


def flops_ratio(flops_a: Sequence[float], flops_b: Sequence[float]) -> float:
    """Mean training FLOPs of runs ``a`` divided by that of runs ``b`` (Table C.2's ratio)."""
    a = [float(v) for v in flops_a if v is not None and math.isfinite(float(v))]
    b = [float(v) for v in flops_b if v is not None and math.isfinite(float(v))]
    if not a or not b or sum(b) == 0:
        return math.nan
    return (sum(a) / len(a)) / (sum(b) / len(b))


@torch.no_grad()
def gate_summary(model: nn.Module, x: Tensor, chunk: int = 4096) -> dict[str, Any]:
    """Mean expert weights per task and the number of selected experts (eval mode).

    Returns:
        ``weights`` (T, n) (per-example: mean over ``x``), ``selected_per_task`` (T,) (number of
        nonzero weights, per-example: mean over ``x``), and for Gumbel-softmax gates
        ``expected_nonzeros_per_task`` (Σ ψ_i). Empty for models without gates.
    """
    was = model.training
    model.eval()
    ws, counts, n = None, None, 0
    for start in range(0, x.shape[0], chunk):
        xb = x[start : start + chunk]
        w = model(xb).gate_weights
        if w is None:
            model.train(was)
            return {}
        if w.dim() == 2:  # static
            ws, counts, n = w.clone(), (w != 0).sum(-1).float(), 1
            break
        ws = w.sum(0) if ws is None else ws + w.sum(0)
        c = (w != 0).sum(-1).float().sum(0)
        counts = c if counts is None else counts + c
        n += xb.shape[0]
    assert ws is not None and counts is not None
    res: dict[str, Any] = {
        "weights": (ws / n).tolist(),
        "selected_per_task": (counts / n).tolist(),
    }
    gate = next((g for g in model.modules() if isinstance(g, Gate)), None)
    diag = gate.diagnostics() if gate is not None and gate.static else {}
    if "expected_nonzeros" in diag:  # Gumbel-softmax
        res["expected_nonzeros_per_task"] = diag["expected_nonzeros"].reshape(-1).tolist()
    model.train(was)
    return res


def gate_metrics(model: nn.Module, x: Tensor) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, extras) of the trained gates on ``x`` (:func:`gate_summary`): mean selected
    experts (overall and per task, ``selected_experts[_task<t>]``), Gumbel-softmax's mean
    ``expected_nonzeros``, and the mean weights rounded to 4 digits (``gate_weights``)."""
    gs = gate_summary(model, x)
    if not gs:
        return {}, {}
    metrics: dict[str, Any] = {"selected_experts": float(np.mean(gs["selected_per_task"]))}
    for t, v in enumerate(gs["selected_per_task"]):
        metrics[f"selected_experts_task{t + 1}"] = v
    if "expected_nonzeros_per_task" in gs:
        metrics["expected_nonzeros"] = float(np.mean(gs["expected_nonzeros_per_task"]))
    weights = [[round(float(v), 4) for v in row] for row in gs["weights"]]
    return metrics, {"gate_weights": weights}
