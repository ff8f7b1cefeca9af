"""Measurements during and after training: Table C.2's gate convergence and expert FLOPs.

Table C.2 (gate convergence and FLOPs) is measured during training by :class:`TrainingMonitor`:

* **steps until S(Z) is binary**: every ``check_every`` steps the DSelect-k gates' smooth-step
  outputs are checked (static: S(Z) of every task's gate; per-example: S(Wx) of every example
  of the current batch). The first checked step at which all are exactly 0 or 1 is reported as
  a percentage of the run's training steps (an upper bound, by at most ``check_every`` steps).
* **expert FLOPs during training**: at every training step, the number of experts each example
  actually needs is counted from the gate weights of that step: an expert is needed for an
  example if some task's gate gives it a nonzero weight (static gates: the union over tasks,
  the same for every example; per-example gates: per example). All experts have the same cost,
  so a forward+backward pass of one expert on one example costs ``3 × F`` with ``F`` the
  expert's forward FLOPs (backward ≈ 2 × forward) and the training expert FLOPs of a run are
  ``3 F Σ_steps Σ_examples needed(step, example)``. The FLOPs ratio DSelect-k / Top-k divides
  these totals (mean over repetitions) for the same setting and gating kind (static vs. static,
  per-example vs. per-example). Gates, towers and the embedding bottom are not counted (they
  are the same for both gates, and small). Our MoE's conditional computation
  (:class:`~dselectk.models.MultiGateMoE`) skips exactly the experts no weight uses, batch-wide.

:func:`gate_summary` measures the trained gates (mean weights, selected experts).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dselectk.gates import DSelectK, GumbelSoftmaxGate
from dselectk.progress import tqdm

__all__ = ["TrainingMonitor", "flops_ratio", "gate_summary", "training_expert_flops"]


class TrainingMonitor(nn.Module):
    """Wraps a multi-task model to measure, during training, what Table C.2 needs.

    Transparent for the training loop (returns the model's output). On every training forward
    pass (grad enabled, train mode) it records the mean number of experts needed per example
    (see the module docstring), and every ``check_every`` steps whether the DSelect-k gates'
    S(Z) is binary. It also drives a progress bar in examples with the throughput
    (examples/s).

    Args:
        model: a :class:`~dselectk.models.MultiGateMoE` or
            :class:`~dselectk.models.SharedBottom`.
        check_every: steps between two binary checks.
        progress: show a progress bar.
        total_examples: examples of the whole run (for the bar).
        desc: bar label.
        position: bar line (a sweep worker's own line; None: tqdm's default).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        check_every: int = 10,
        progress: bool = False,
        total_examples: int | None = None,
        desc: str = "",
        position: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.check_every = max(1, int(check_every))
        self.steps = 0
        self.examples = 0
        self.needed_sum = 0.0
        """Σ_steps Σ_examples experts needed."""
        self.needed_per_step: list[float] = []
        self.binary_checks: list[tuple[int, float]] = []
        self.first_binary_step: int | None = None
        self.first_binary_step_task: dict[int, int] = {}
        """Per task gate: first checked step at which its S(Z) (all examples) was binary."""
        self.record_every = 0
        """Record the gate weights of the training batch every N steps (0: never)."""
        self.recorded_steps: list[int] = []
        self.recorded_weights: list[Tensor] = []
        self.dselect_gates = [m for m in model.modules() if isinstance(m, DSelectK)]
        self.bar = tqdm(
            total=total_examples,
            disable=not progress,
            unit="ex",
            unit_scale=True,
            desc=desc,
            position=position,
        )
        self.t0 = time.perf_counter()

    def forward(self, x: Tensor) -> Any:
        out = self.model(x)
        if self.training and torch.is_grad_enabled():
            self._record(x, out)
        return out

    @torch.no_grad()
    def _record(self, x: Tensor, out: Any) -> None:
        b = int(x.shape[0])
        self.steps += 1
        self.examples += b
        w = getattr(out, "gate_weights", None)
        if w is not None:
            nz = w != 0
            if nz.dim() == 2:  # static (T, n): same experts for every example
                per_example = float(nz.any(dim=0).sum())
            else:  # (B, T, n)
                per_example = float(nz.any(dim=1).sum(dim=-1).float().mean())
            self.needed_per_step.append(per_example)
            self.needed_sum += per_example * b
            if self.record_every and (self.steps == 1 or self.steps % self.record_every == 0):
                mean_w = w.detach() if w.dim() == 2 else w.detach().mean(dim=0)
                self.recorded_steps.append(self.steps)
                self.recorded_weights.append(mean_w.float().cpu().clone())
        if self.dselect_gates and (self.steps == 1 or self.steps % self.check_every == 0):
            per_task = self.task_binary_fractions(x)
            frac = min(per_task)
            self.binary_checks.append((self.steps, frac))
            if frac >= 1.0 and self.first_binary_step is None:
                self.first_binary_step = self.steps
            for t, f in enumerate(per_task):
                if f >= 1.0 and t not in self.first_binary_step_task:
                    self.first_binary_step_task[t] = self.steps
        self.bar.update(b)
        if self.steps % 20 == 0:
            rate = self.examples / max(1e-9, time.perf_counter() - self.t0)
            self.bar.set_postfix({"ex/s": f"{rate:.0f}"}, refresh=False)

    @torch.no_grad()
    def task_binary_fractions(self, x: Tensor) -> list[float]:
        """Per task gate (of every DSelect-k gate module): binary S(Z) (1/0), or per-example
        the fraction of the examples of ``x`` whose S(Wx) is binary."""
        bottom = getattr(self.model, "bottom", None)
        h = x if bottom is None else bottom(x)
        fracs: list[float] = []
        for g in self.dselect_gates:
            r = g.is_binary(None if g.static else h)
            fracs.extend(float(v) for v in r.float().reshape(-1))
        return fracs

    @torch.no_grad()
    def binary_fraction(self, x: Tensor) -> float:
        """Smallest fraction, over the DSelect-k gates and tasks, of binary S(Z) (or S(Wx))."""
        return min(self.task_binary_fractions(x))

    def close(self) -> float:
        """Close the bar; returns the measured training throughput (examples/s)."""
        self.bar.close()
        return self.examples / max(1e-9, time.perf_counter() - self.t0)


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


def _inner(model: nn.Module) -> nn.Module:
    return model.model if isinstance(model, TrainingMonitor) else model


@torch.no_grad()
def gate_summary(model: nn.Module, x: Tensor, chunk: int = 4096) -> dict[str, Any]:
    """Mean expert weights per task and the number of selected experts (eval mode).

    Returns:
        ``weights`` (T, n) (per-example: mean over ``x``), ``selected_per_task`` (T,) (number of
        nonzero weights, per-example: mean over ``x``), and for Gumbel-softmax gates
        ``expected_nonzeros_per_task`` (Σ ψ_i). Empty for models without gates.
    """
    m = _inner(model)
    was = m.training
    m.eval()
    ws, counts, n = None, None, 0
    for start in range(0, x.shape[0], chunk):
        xb = x[start : start + chunk]
        out = m(xb)
        w = out.gate_weights
        if w is None:
            m.train(was)
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
    gumbel = [g for g in m.modules() if isinstance(g, GumbelSoftmaxGate)]
    if gumbel and gumbel[0].static:
        res["expected_nonzeros_per_task"] = gumbel[0].expected_nonzeros().reshape(-1).tolist()
    m.train(was)
    return res
