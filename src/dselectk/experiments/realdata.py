"""Shared runner of the real-data experiments (Sections 4.1–4.2, Appendices C.3, C.4, D.1, D.2).

An :class:`Experiment` says how to load the data, build a model for a gate, and which losses
and paper numbers apply; :func:`run_experiment` then runs (or resumes) the sweep over
settings × gates × repetitions, with an optional random-grid tuning phase (``--full``), and
:func:`write_report` rebuilds ``summary.json``, ``report.md`` and the PNG plots from the run
records alone.

Every finished run is one JSON record (:class:`~dselectk.experiments.records.RunStore`), keyed
by the hash of its resolved config, written atomically: an interrupted sweep restarted with the
same command skips finished runs and never leaves partial records.

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
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from dselectk.experiments.records import (
    RunStore,
    atomic_write_json,
    atomic_write_text,
    format_mean_se,
    mean_se,
    summarize,
)
from dselectk.gates import DSelectK, GumbelSoftmaxGate
from dselectk.training import TaskData, TrainConfig, evaluate, train

__all__ = [
    "GATE_KINDS",
    "LABELS",
    "Experiment",
    "TrainingMonitor",
    "add_common_arguments",
    "flops_ratio",
    "run_experiment",
    "train_one",
    "training_expert_flops",
    "write_report",
]

#: experiment gate name → (registry gate name or "shared_bottom", per-example?)
GATE_KINDS: dict[str, tuple[str, bool]] = {
    "dselect_k_static": ("dselect_k", False),
    "topk_static": ("topk", False),
    "gumbel_softmax": ("gumbel_softmax", False),
    "dselect_k_per_example": ("dselect_k", True),
    "topk_per_example": ("topk", True),
    "softmax": ("softmax", False),
    "shared_bottom": ("shared_bottom", False),
}
LABELS: dict[str, str] = {
    "dselect_k_static": "Static DSelect-k",
    "topk_static": "Static Top-k",
    "gumbel_softmax": "Static Gumbel Softmax",
    "dselect_k_per_example": "Per-example DSelect-k",
    "topk_per_example": "Per-example Top-k",
    "softmax": "Softmax MoE",
    "shared_bottom": "Shared Bottom",
}
DEFAULT_GATES = list(GATE_KINDS)


# --------------------------------------------------------------------------------------------
# experiment description
# --------------------------------------------------------------------------------------------
@dataclass
class Splits:
    """Train/validation/test task data plus what the model builder needs to know."""

    train: TaskData
    val: TaskData
    test: TaskData
    meta: dict[str, Any] = field(default_factory=dict)
    """Model-building facts (vocabulary sizes, ...); also saved in the summary."""


@dataclass
class Experiment:
    """How one real-data experiment is run and reported.

    Attributes:
        name: CLI name, also ``config["experiment"]`` of every record ("movielens",
            "multi-mnist", "multi-fashion").
        setting_key: name of the per-setting config key (e.g. "alpha"), or None.
        losses: the per-task losses given to :func:`~dselectk.training.train`.
        task_names: labels of the tasks.
        optimizer: "adagrad" / "adam".
        batch_size: examples per step.
        quick_hparams: gate → hyperparameters of the quick default.
        grid: gate → {hyperparameter: values} of the ``--full`` random grid search.
        select: "min_loss" (weighted validation loss) or "max_accuracy" (mean validation
            accuracy), the tuning metric.
        build_model: (gate, hparams, meta) → model returning a ``MultiTaskOutput``.
        task_weights: setting value → task weights of the summed loss.
        expert_flops: (hparams, meta) → forward FLOPs of one expert on one example.
    """

    name: str
    setting_key: str | None
    losses: Sequence[Any]
    task_names: Sequence[str]
    optimizer: str
    batch_size: int
    quick_hparams: Mapping[str, Mapping[str, Any]]
    grid: Mapping[str, Mapping[str, Sequence[Any]]]
    select: str
    build_model: Callable[[str, Mapping[str, Any], Mapping[str, Any]], nn.Module]
    task_weights: Callable[[Any], list[float]]
    expert_flops: Callable[[Mapping[str, Any], Mapping[str, Any]], float]


# --------------------------------------------------------------------------------------------
# monitoring (Table C.2) and throughput
# --------------------------------------------------------------------------------------------
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
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        check_every: int = 10,
        progress: bool = False,
        total_examples: int | None = None,
        desc: str = "",
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
            total=total_examples, disable=not progress, unit="ex", unit_scale=True, desc=desc
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


# --------------------------------------------------------------------------------------------
# one run
# --------------------------------------------------------------------------------------------
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


def init_seed(seed: int, gate: str, setting: Any, rep: int, phase: str = "final") -> int:
    """Initialisation seed of one run (stable, independent of sweep order)."""
    key = f"{seed}|{gate}|{json.dumps(setting)}|{rep}|{phase}"
    return int.from_bytes(key.encode(), "little") % 2_147_483_647


def _subsample(steps: Sequence[int], values: Sequence[Any], limit: int) -> tuple[list, list]:
    if len(steps) <= limit:
        return list(steps), list(values)
    idx = np.unique(np.linspace(0, len(steps) - 1, limit).round().astype(int))
    return [steps[i] for i in idx], [values[i] for i in idx]


def train_one(
    exp: Experiment,
    gate: str,
    hparams: Mapping[str, Any],
    setting: Any,
    seed: int,
    data: Splits,
    *,
    progress: bool = False,
    record_trajectory: bool = True,
    desc: str = "",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train one model and measure it.

    Returns:
        (metrics, extra): scalar metrics for the record's ``metrics`` and bulky extras (gate
        weights, trajectories, binary checks) stored beside them.
    """
    torch.manual_seed(seed)
    random.seed(seed)
    model = exp.build_model(gate, hparams, data.meta)
    weights = exp.task_weights(setting)
    epochs = int(hparams["epochs"])
    n_train = len(data.train)
    steps_total = epochs * math.ceil(n_train / exp.batch_size)
    record_every = max(1, steps_total // 60) if record_trajectory else 0
    monitor = TrainingMonitor(
        model,
        check_every=max(1, min(10, steps_total // 200)),
        progress=progress,
        total_examples=epochs * n_train,
        desc=desc,
    )
    monitor.record_every = record_every
    cfg = TrainConfig(
        optimizer=exp.optimizer,
        lr=float(hparams["lr"]),
        batch_size=exp.batch_size,
        epochs=epochs,
        task_weights=weights,
        seed=seed,
        record_every=0,  # the monitor records the training batches' weights (no extra pass)
        progress=False,
    )
    t0 = time.perf_counter()
    try:
        hist = train(monitor, data.train, list(exp.losses), cfg)
    finally:
        throughput = monitor.close()
    train_seconds = time.perf_counter() - t0
    test = evaluate(model, data.test, list(exp.losses))
    val = evaluate(model, data.val, list(exp.losses))
    metrics: dict[str, Any] = {
        "train_seconds": train_seconds,
        "examples_per_second": throughput,
        "steps": hist.steps,
        "final_train_loss": hist.train_loss[-1] if hist.train_loss else math.nan,
    }
    for split, res in (("test", test), ("val", val)):
        for t, (loss, acc) in enumerate(zip(res["loss"], res["accuracy"])):
            metrics[f"{split}_loss_task{t + 1}"] = loss
            if math.isfinite(acc):
                metrics[f"{split}_accuracy_task{t + 1}"] = acc
        metrics[f"{split}_loss"] = sum(w * v for w, v in zip(weights, res["loss"]))
        accs = [a for a in res["accuracy"] if math.isfinite(a)]
        if accs:
            metrics[f"{split}_mean_accuracy"] = sum(accs) / len(accs)
    extra: dict[str, Any] = {}
    gs = gate_summary(model, data.test.x)
    if gs:
        metrics["selected_experts"] = float(np.mean(gs["selected_per_task"]))
        for t, v in enumerate(gs["selected_per_task"]):
            metrics[f"selected_experts_task{t + 1}"] = v
        if "expected_nonzeros_per_task" in gs:
            metrics["expected_nonzeros"] = float(np.mean(gs["expected_nonzeros_per_task"]))
        extra["gate_weights"] = [[round(float(v), 4) for v in row] for row in gs["weights"]]
    if monitor.needed_per_step:
        flops_f = exp.expert_flops(hparams, data.meta)
        sizes = [exp.batch_size] * len(monitor.needed_per_step)
        rem = n_train % exp.batch_size
        if rem:
            per_epoch = math.ceil(n_train / exp.batch_size)
            for i in range(per_epoch - 1, len(sizes), per_epoch):
                sizes[i] = rem
        metrics["train_expert_flops"] = training_expert_flops(
            monitor.needed_per_step, sizes, flops_f
        )
        metrics["mean_experts_needed"] = monitor.needed_sum / max(1, monitor.examples)
        metrics["expert_forward_flops"] = flops_f
    if monitor.dselect_gates:
        b = monitor.first_binary_step
        metrics["binary_reached"] = 0.0 if b is None else 1.0
        if b is not None:
            metrics["steps_until_binary"] = b
            metrics["pct_steps_until_binary"] = 100.0 * b / max(1, hist.steps)
        metrics["final_binary_fraction"] = monitor.binary_checks[-1][1]
        n_tasks = len(weights)
        for t in range(n_tasks):
            bt = monitor.first_binary_step_task.get(t)
            metrics[f"binary_reached_task{t + 1}"] = 0.0 if bt is None else 1.0
            if bt is not None:
                metrics[f"pct_steps_until_binary_task{t + 1}"] = 100.0 * bt / max(1, hist.steps)
        cs, cv = _subsample(
            [c[0] for c in monitor.binary_checks], [c[1] for c in monitor.binary_checks], 200
        )
        extra["binary_checks"] = {"steps": cs, "fraction": [round(v, 4) for v in cv]}
    if record_trajectory and monitor.recorded_steps:
        ss, ws = _subsample(monitor.recorded_steps, monitor.recorded_weights, 120)
        extra["trajectory"] = {
            "steps": ss,
            "weights": [
                [[round(float(v), 4) for v in row] for row in w.reshape(-1, w.shape[-1])]
                for w in ws
            ],
        }
    return metrics, extra


# --------------------------------------------------------------------------------------------
# sweep
# --------------------------------------------------------------------------------------------
def _config(
    exp: Experiment,
    gate: str,
    setting: Any,
    hp: Mapping[str, Any],
    rep: int,
    seed: int,
    base_seed: int,
    data_cfg: Mapping[str, Any],
    phase: str,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "experiment": exp.name,
        "phase": phase,
        "gate": gate,
        "hparams": dict(sorted(hp.items())),
        "rep": rep,
        "init_seed": seed,
        "seed": base_seed,
        "optimizer": exp.optimizer,
        "batch_size": exp.batch_size,
        "data": dict(data_cfg),
    }
    if exp.setting_key is not None:
        cfg[exp.setting_key] = setting
    return cfg


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """All points of a hyperparameter grid (sorted keys)."""
    keys = sorted(grid)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(grid[k] for k in keys))]


def _better(exp: Experiment, a: float, b: float) -> bool:
    if not math.isfinite(a):
        return False
    if not math.isfinite(b):
        return True
    return a < b if exp.select == "min_loss" else a > b


def tune(
    exp: Experiment,
    gate: str,
    setting: Any,
    data: Splits,
    store: RunStore,
    *,
    points: int,
    trials: int,
    base_seed: int,
    data_cfg: Mapping[str, Any],
    overrides: Mapping[str, Any],
    progress: bool,
) -> dict[str, Any]:
    """Random grid search (Appendix D): ``points`` random grid points × ``trials`` runs each.

    Each trial is a resumable ``phase="tune"`` record. The point with the best mean validation
    metric wins; for Gumbel-softmax only points whose expected number of nonzeros is <= 4 are
    eligible (as in the paper).
    """
    grid = {**exp.grid[gate]}
    for k, v in overrides.items():
        if v is not None:
            grid[k] = [v]
    pts = grid_points(grid)
    rng = random.Random(f"{exp.name}|{gate}|{json.dumps(setting)}|{base_seed}")
    if points < len(pts):
        pts = rng.sample(pts, points)
    metric = "val_loss" if exp.select == "min_loss" else "val_mean_accuracy"
    best_hp, best_val = dict(exp.quick_hparams[gate]), math.nan
    for i, point in enumerate(pts):
        hp = {**exp.quick_hparams[gate], **point}
        vals, nnz = [], []
        for trial in range(trials):
            s = init_seed(base_seed, gate, setting, trial, f"tune{i}")
            cfg = _config(exp, gate, setting, hp, trial, s, base_seed, data_cfg, "tune")
            path = store.path(_run_id(cfg))
            if path.is_file():
                rec = json.loads(path.read_text(encoding="utf-8"))
                m = rec["metrics"]
            else:
                m, _ = train_one(
                    exp,
                    gate,
                    hp,
                    setting,
                    s,
                    data,
                    progress=progress,
                    record_trajectory=False,
                    desc=f"tune {gate} {i + 1}/{len(pts)} trial {trial + 1}",
                )
                store.save(cfg, m)
            vals.append(m.get(metric, math.nan))
            nnz.append(m.get("expected_nonzeros", 0.0))
        v = mean_se(vals)["mean"]
        if gate == "gumbel_softmax" and float(np.mean(nnz)) > 4.0:
            continue
        if _better(exp, float(v), float(best_val)):
            best_hp, best_val = hp, float(v)
    return {"hparams": best_hp, "val_metric": best_val, "metric": metric, "points": len(pts)}


def _run_id(cfg: Mapping[str, Any]) -> str:
    from dselectk.experiments.records import run_id

    return run_id(cfg)


def add_common_arguments(p: argparse.ArgumentParser, default_out: str) -> None:
    """Flags shared by the real-data experiments."""
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="data folder (default: $DSELECTK_DATA or ~/.cache/dselectk)",
    )
    p.add_argument("--out", type=Path, default=Path(default_out), help="results folder")
    p.add_argument(
        "--repetitions",
        "--reps",
        type=int,
        default=None,
        dest="repetitions",
        help="repetitions per gate and setting (quick 2, full 100)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data and of the runs")
    p.add_argument("--gates", nargs="+", default=DEFAULT_GATES, choices=DEFAULT_GATES)
    p.add_argument(
        "--full",
        action="store_true",
        help="paper protocol: random grid search of Appendix D, then 100 repetitions",
    )
    p.add_argument("--epochs", type=int, default=None, help="override the epochs of every run")
    p.add_argument("--lr", type=float, default=None, help="override the learning rate")
    p.add_argument(
        "--grid-points",
        type=int,
        default=20,
        help="--full: random grid points per gate and setting",
    )
    p.add_argument("--trials", type=int, default=5, help="--full: trials per grid point")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: fastest for these small models on a shared machine)",
    )


def set_threads(args: argparse.Namespace) -> None:
    """Apply ``--threads``."""
    n = getattr(args, "threads", None)
    if n:
        torch.set_num_threads(int(n))


def run_experiment(
    exp: Experiment,
    args: argparse.Namespace,
    settings: Sequence[Any],
    data: Splits,
    data_cfg: Mapping[str, Any],
    *,
    quick_reps: int = 2,
    quick_epochs: int | None = None,
    notes: Sequence[str] = (),
) -> int:
    """Run (or resume) the sweep settings × gates × repetitions, then write the report.

    Args:
        exp: the experiment.
        args: parsed flags (:func:`add_common_arguments` and the experiment's own).
        settings: the values of ``exp.setting_key`` (``[None]`` when there is none).
        data: the loaded splits.
        data_cfg: data settings recorded in every config (resume identity).
        quick_reps: repetitions of the quick default.
        quick_epochs: epochs of the quick default (overrides the per-gate quick values).
        notes: lines for the report (data choices, reductions).
    """
    out = Path(args.out)
    store = RunStore(out)
    reps = args.repetitions if args.repetitions is not None else (100 if args.full else quick_reps)
    progress = not args.no_progress
    overrides = {"epochs": args.epochs, "lr": args.lr}
    if not args.full and args.epochs is None and quick_epochs is not None:
        overrides["epochs"] = quick_epochs
    t0 = time.perf_counter()
    selected: dict[str, Any] = {}
    sel_path = out / "selected_hparams.json"
    for setting, gate in itertools.product(settings, args.gates):
        key = f"{gate}" if exp.setting_key is None else f"{gate}/{exp.setting_key}={setting}"
        if args.full:
            choice = tune(
                exp,
                gate,
                setting,
                data,
                store,
                points=args.grid_points,
                trials=args.trials,
                base_seed=args.seed,
                data_cfg=data_cfg,
                overrides=overrides,
                progress=progress,
            )
            hp = dict(choice["hparams"])
            selected[key] = {**choice, "source": "random grid search (--full)"}
        else:
            hp = {**exp.quick_hparams[gate]}
            hp.update({k: v for k, v in overrides.items() if v is not None})
            selected[key] = {"hparams": hp, "source": "quick default (untuned)"}
        atomic_write_json(sel_path, selected)
        for rep in range(reps):
            s = init_seed(args.seed, gate, setting, rep)
            cfg = _config(exp, gate, setting, hp, rep, s, args.seed, data_cfg, "final")
            if store.done(cfg):
                continue
            desc = f"{LABELS[gate]} {key.split('/')[-1] if '/' in key else ''} rep {rep}".strip()
            metrics, extra = train_one(
                exp,
                gate,
                hp,
                setting,
                s,
                data,
                progress=progress,
                record_trajectory=rep == 0,
                desc=desc,
            )
            store.save(cfg, metrics, **extra)
            if progress:
                m = metrics
                msg = f"[{desc}] test loss {m['test_loss']:.4f}"
                if "test_mean_accuracy" in m:
                    msg += f", mean acc {m['test_mean_accuracy']:.4f}"
                if "selected_experts" in m:
                    msg += f", experts {m['selected_experts']:.2f}"
                msg += f", {m['examples_per_second']:.0f} ex/s, {m['train_seconds']:.0f}s"
                tqdm.write(msg)
    wall = time.perf_counter() - t0
    prev_wall = 0.0
    if (out / "run_info.json").is_file():
        try:
            prev_wall = float(
                json.loads((out / "run_info.json").read_text()).get("wall_seconds") or 0.0
            )
        except (json.JSONDecodeError, ValueError, TypeError):
            prev_wall = 0.0
    run_info = {
        "command": " ".join(["dselectk", *sys.argv[1:]]),
        "wall_seconds": prev_wall + wall,
        "mode": "full" if args.full else "quick",
        "repetitions": reps,
        "notes": list(notes),
        "data": dict(data_cfg),
        "meta": {k: v for k, v in data.meta.items() if isinstance(v, (int, float, str))},
    }
    atomic_write_json(out / "run_info.json", run_info)
    report = _report_module(exp.name)
    report.write_report(out)
    print((out / "report.md").read_text(encoding="utf-8"))
    return 0


def _report_module(name: str) -> Any:
    import importlib

    mod = "movielens" if name == "movielens" else "multi_mnist"
    return importlib.import_module(f"dselectk.experiments.{mod}")


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
@dataclass
class ReportSpec:
    """What an experiment's report shows (given by movielens.py / multi_mnist.py)."""

    name: str
    title: str
    setting_key: str | None
    task_names: Sequence[str]
    tables: Callable[[Mapping[tuple[Any, str], Mapping[str, Any]], Sequence[Any]], list[str]]
    """(rows keyed by (setting, gate), settings) → markdown lines of the paper tables."""
    paper_c2: Mapping[str, Mapping[str, float]]
    """Table C.2 of the paper: column label → {"pct": ..., "flops": ...}."""
    c2_column: Callable[[Any], str]
    """setting → Table C.2 column label."""


def fmt(m: Mapping[str, Any] | None, scale: float = 1.0, digits: int = 2) -> str:
    """``mean ± se`` of a summarised metric (``-`` when missing)."""
    return format_mean_se(m, digits, scale=scale, missing="-", show_n=True)


def _final_records(records: Iterable[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    return [
        r
        for r in records
        if r["config"].get("phase") == "final" and r["config"].get("experiment") == name
    ]


def current_records(
    records: Sequence[Mapping[str, Any]],
    setting_key: str | None,
    data_cfg: Mapping[str, Any] | None,
    selected: Mapping[str, Any],
) -> list[Mapping[str, Any]]:
    """The records of the latest sweep command of a results folder.

    A folder may hold records of earlier commands with other flags (e.g. ``--epochs``); only
    those with the data settings of ``run_info.json`` and the hyperparameters of
    ``selected_hparams.json`` (when these files are present) are summarised, so that a table
    row never mixes configurations. The others stay on disk (and are reused when the same
    flags are run again).
    """
    out = []
    for r in records:
        c = r["config"]
        if data_cfg is not None and c.get("data") != dict(data_cfg):
            continue
        key = (
            c["gate"] if setting_key is None else f"{c['gate']}/{setting_key}={c.get(setting_key)}"
        )
        sel = selected.get(key)
        if sel is not None and dict(sorted(sel["hparams"].items())) != c.get("hparams"):
            continue
        out.append(r)
    return out


def table_c2(
    spec: ReportSpec,
    rows: Mapping[tuple[Any, str], Mapping[str, Any]],
    records: Sequence[Mapping[str, Any]],
    settings: Sequence[Any],
) -> tuple[list[str], dict[str, Any]]:
    """Markdown lines and values of Table C.2 (ours beside the paper's)."""
    lines = [
        "| column | gating | % steps until binary S(Z), all gates: ours | runs binary "
        "| per task gate: ours (runs binary) | paper | FLOPs DSelect-k / Top-k: ours | paper |",
        "|---|---|---|---|---|---|---|---|",
    ]
    values: dict[str, Any] = {}
    for setting in settings:
        col = spec.c2_column(setting)
        paper = spec.paper_c2.get(col, {})
        for kind in ("static", "per_example"):
            dk, tk = f"dselect_k_{kind}", f"topk_{kind}"
            if (setting, dk) not in rows:
                continue
            m = rows[(setting, dk)]["metrics"]
            recs = [
                r
                for r in records
                if r["config"]["gate"] == dk
                and r["config"].get(spec.setting_key or "", None) == setting
            ]
            reached = sum(1 for r in recs if r["metrics"].get("binary_reached"))
            ratio = math.nan
            if (setting, tk) in rows:
                fa = [r["metrics"].get("train_expert_flops") for r in recs]
                fb = [
                    r["metrics"].get("train_expert_flops")
                    for r in records
                    if r["config"]["gate"] == tk
                    and r["config"].get(spec.setting_key or "", None) == setting
                ]
                ratio = flops_ratio(fa, fb)
            values[f"{col}/{kind}"] = {
                "pct_steps_until_binary": m.get("pct_steps_until_binary"),
                "runs_binary": reached,
                "runs": len(recs),
                "flops_ratio": ratio,
            }
            pct = fmt(m.get("pct_steps_until_binary"))
            ratio_s = "-" if not math.isfinite(ratio) else f"{ratio:.2f}"
            paper_pct = paper.get("pct", math.nan) if kind == "static" else math.nan
            paper_fl = paper.get("flops", math.nan) if kind == "static" else math.nan
            per_task = []
            for t in range(len(spec.task_names)):
                key = f"binary_reached_task{t + 1}"
                with_key = [r for r in recs if key in r["metrics"]]
                rt = sum(1 for r in with_key if r["metrics"][key])
                per_task.append(
                    f"T{t + 1}: {fmt(m.get(f'pct_steps_until_binary_task{t + 1}'))} "
                    f"({rt}/{len(with_key)})"
                )
            lines.append(
                f"| {col} | {kind.replace('_', '-')} | {pct} | {reached}/{len(recs)} | "
                f"{'; '.join(per_task)} | {_num(paper_pct)} | {ratio_s} | {_num(paper_fl)} |"
            )
    return lines, values


def _num(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v:g}"


def write_report(results_dir: Path, spec: ReportSpec) -> None:
    """Rebuild ``summary.json``, ``report.md`` and the plots from the run records alone."""
    from dselectk.plots.realdata import plot_task_heatmap, plot_task_trajectories

    results_dir = Path(results_dir)
    all_records = RunStore(results_dir).load()
    info: dict[str, Any] = {}
    if (results_dir / "run_info.json").is_file():
        try:
            info = json.loads((results_dir / "run_info.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            info = {}
    selected: dict[str, Any] = {}
    if (results_dir / "selected_hparams.json").is_file():
        try:
            selected = json.loads((results_dir / "selected_hparams.json").read_text("utf-8"))
        except json.JSONDecodeError:
            selected = {}
    finals = _final_records(all_records, spec.name)
    records = current_records(finals, spec.setting_key, info.get("data"), selected)
    stale = len(finals) - len(records)
    tune_count = sum(1 for r in all_records if r["config"].get("phase") == "tune")
    group = ["gate"] if spec.setting_key is None else [spec.setting_key, "gate"]
    summary_rows = summarize(records, group)
    rows: dict[tuple[Any, str], Mapping[str, Any]] = {}
    for row in summary_rows:
        setting = row.get(spec.setting_key) if spec.setting_key else None
        rows[(setting, row["gate"])] = row
    settings = sorted({k[0] for k in rows}, key=lambda v: (v is None, v))
    c2_lines, c2_values = table_c2(spec, rows, records, settings)

    plots: list[Path] = []
    plot_dir = results_dir / "plots"
    for setting, gate in sorted(rows, key=lambda k: (str(k[0]), k[1])):
        recs = sorted(
            (
                r
                for r in records
                if r["config"]["gate"] == gate
                and (spec.setting_key is None or r["config"].get(spec.setting_key) == setting)
            ),
            key=lambda r: r["config"]["rep"],
        )
        if not recs:
            continue
        rec = recs[0]
        tag = gate if spec.setting_key is None else f"{gate}_{spec.setting_key}{setting}"
        label = LABELS.get(gate, gate) + (
            "" if spec.setting_key is None else f", {spec.setting_key} = {setting}"
        )
        if rec.get("gate_weights"):
            plots.append(
                plot_task_heatmap(
                    rec["gate_weights"],
                    plot_dir / f"heatmap_{tag}.png",
                    title=f"{spec.title}: expert weights, {label} (rep {rec['config']['rep']})",
                    task_names=spec.task_names,
                )
            )
        traj = rec.get("trajectory")
        if traj and traj.get("steps"):
            plots.append(
                plot_task_trajectories(
                    traj["steps"],
                    traj["weights"],
                    plot_dir / f"trajectory_{tag}.png",
                    title=f"{spec.title}: gate weights during training, {label}",
                    task_names=spec.task_names,
                )
            )

    summary = {
        "experiment": spec.name,
        "group_by": group,
        "rows": summary_rows,
        "table_c2": c2_values,
        "records": len(records),
        "tune_records": tune_count,
        "run_info": info,
        "plots": [str(p.relative_to(results_dir)) for p in plots],
    }
    atomic_write_json(results_dir / "summary.json", summary)

    md = [f"# {spec.title}: reproduction report", ""]
    if info:
        md += [
            f"Command: `{info.get('command')}`  ",
            f"Mode: **{info.get('mode')}**, repetitions per gate and setting: "
            f"{info.get('repetitions')}, cumulative wall time of the sweep commands: "
            f"{float(info.get('wall_seconds') or 0):.0f} s; training time of the summarised "
            f"runs: {sum(float(r['metrics'].get('train_seconds', 0.0)) for r in records):.0f} s.",
            "",
        ]
        if info.get("mode") == "quick":
            md += [
                "**Quick mode**: reduced data, epochs and repetitions, and *untuned* "
                "hyperparameters (no grid search); numbers are indicative only and are not "
                "expected to match the paper's, which are means over 100 repetitions of tuned "
                "models on the full data.",
                "",
            ]
        if info.get("notes"):
            md += ["## Setup and choices", ""] + [f"- {n}" for n in info["notes"]] + [""]
    md += [
        f"Finished runs summarised: {len(records)} (tuning runs: {tune_count}; records of "
        f"earlier commands with other settings, not summarised: {stale}).",
        "",
    ]
    md += spec.tables(rows, settings)
    md += [
        "",
        "## Table C.2: gate convergence and training FLOPs",
        "",
        "Percentage of training steps until S(Z) is binary: first check (every ≤ 10 steps, "
        "per-example gates: every example of the current batch) at which all DSelect-k "
        "smooth-step outputs are exactly 0 or 1 (all gates: both tasks' gates; per task gate: "
        "that task's gate), divided by the run's steps; mean over the runs that reached a "
        "binary S(Z) (the 'runs binary' counts show how many did, of the runs that recorded "
        "it; '-' when none did). FLOPs: expert computations actually needed during training, "
        "counted at every step from that step's "
        "gate weights (an expert is needed for an example if any task's gate gives it a "
        "nonzero weight; static gates: union over tasks), times 3× the expert's forward FLOPs "
        "(forward + backward); gates, towers and embeddings are not counted. The ratio divides "
        "the mean over repetitions of DSelect-k's by Top-k's for the same gating kind. The "
        "paper's numbers are for its tuned models (its table does not say static or "
        "per-example; they are shown on the static rows).",
        "",
        *c2_lines,
        "",
        "## Plots",
        "",
        "Heatmaps of the expert weights of each task's gate (Figure 4-like; per-example gates: "
        "mean over test examples) and gate-weight trajectories during training (Figure C.2-"
        "like: the weights of the training step's batch, recorded about 60 times per run; "
        "per-example gates: mean over the batch; Gumbel-softmax: sampled training masks), "
        "repetition 0:",
        "",
    ]
    md += [f"- [{p.name}]({p.relative_to(results_dir)})" for p in plots]
    atomic_write_text(results_dir / "report.md", "\n".join(md) + "\n")
