"""One real-data run (:func:`train_one`: the library's training loop observed by a
:class:`~dselectk_research.monitor.GateMonitor`, then evaluated and its gates measured) and the
``--full`` random grid search (:func:`tune`)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dselectk.optim import make_optimizer
from dselectk.telemetry import RoutingTelemetry
from dselectk.training import (
    Callback,
    TrainConfig,
    TrainingDivergedError,
    evaluate,
    seed_everything,
    train,
)
from dselectk.variants import total_steps
from dselectk_research.best import best_configuration
from dselectk_research.executors import progress_position
from dselectk_research.keras_init import init_module_
from dselectk_research.monitor import GateMonitor, gate_metrics
from dselectk_research.realdata.spec import FINITE, Experiment, Splits, init_seed, record_config
from dselectk_research.records import RunStore, run_id
from dselectk_research.runner import grid_points, sample_points


def diverged_metrics(
    error: BaseException, train_seconds: float, num_tasks: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (metrics, extra) of a run whose training diverged: NaN losses (JSON null), the step
    and the error, ``"diverged": true`` (see :func:`dselectk_research.records.diverged`)."""
    step = int(getattr(error, "step", 0) or 0)
    metrics: dict[str, Any] = {
        "train_seconds": train_seconds,
        "steps": step,
        "diverged_at_step": step,
        "test_loss": math.nan,
        "val_loss": math.nan,
    }
    for t in range(num_tasks):
        metrics[f"test_loss_task{t + 1}"] = math.nan
        metrics[f"val_loss_task{t + 1}"] = math.nan
    return metrics, {"diverged": True, "diverged_error": str(error).splitlines()[0][:300]}


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
    telemetry_dir: Path | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train one model and measure it: (scalar metrics, bulky extras such as gate weights and
    trajectories). ``telemetry_dir``: log routing telemetry there about 60 times per run."""
    seed_everything(seed)
    model = init_module_(exp.build_model(gate, hparams, data.meta), exp.init)
    weights = exp.task_weights(setting) if exp.task_weights else [1.0] * len(exp.losses)
    epochs = int(hparams["epochs"])
    steps_total = total_steps(epochs, len(data.train), exp.batch_size)
    monitor = GateMonitor(
        model,
        check_every=max(1, min(10, steps_total // 200)),
        record_every=max(1, steps_total // 60) if record_trajectory else 0,
    )
    callbacks: list[Callback] = [monitor]
    if telemetry_dir is not None:
        every = max(1, steps_total // 60)
        callbacks.append(RoutingTelemetry(telemetry_dir, every=every, module=model))
    cfg = TrainConfig(
        optimizer=exp.optimizer,
        lr=float(hparams["lr"]),
        batch_size=exp.batch_size,
        epochs=epochs,
        task_weights=weights,
        seed=seed,
        progress=progress,
        desc=desc,
        position=progress_position(),
        search=None,  # the study's own settings: no swap search
    )
    t0 = time.perf_counter()
    opt = make_optimizer(exp.optimizer, model.parameters(), cfg.lr, defaults=exp.optimizer_defaults)
    try:
        hist = train(model, data.train, list(exp.losses), cfg, optimizer=opt, callbacks=callbacks)
    except TrainingDivergedError as e:  # recorded as diverged: counted, never averaged
        return diverged_metrics(e, time.perf_counter() - t0, len(weights))
    train_seconds = time.perf_counter() - t0
    metrics: dict[str, Any] = {
        "train_seconds": train_seconds,
        "examples_per_second": monitor.examples / max(1e-9, train_seconds),
        "steps": hist.steps,
        "final_train_loss": hist.train_loss[-1] if hist.train_loss else math.nan,
    }
    for split, d in (("test", data.test), ("val", data.val)):
        res = evaluate(model, d, list(exp.losses))
        for t, (loss, acc) in enumerate(zip(res["loss"], res["accuracy"])):
            metrics[f"{split}_loss_task{t + 1}"] = loss
            if math.isfinite(acc):
                metrics[f"{split}_accuracy_task{t + 1}"] = acc
        metrics[f"{split}_loss"] = sum(w * v for w, v in zip(weights, res["loss"]))
        accs = [a for a in res["accuracy"] if math.isfinite(a)]
        if accs:
            metrics[f"{split}_mean_accuracy"] = sum(accs) / len(accs)
    if not all(math.isfinite(float(metrics[k])) for k in FINITE):
        # the model trained to finite losses, then evaluated to NaN or inf: diverged too
        return metrics, {"diverged": True}
    gm, extra = gate_metrics(model, data.test.x)
    metrics.update(gm)
    flops = exp.expert_flops(hparams, data.meta) if monitor.needed_per_step else 0.0
    measured, more = monitor.results(hist.steps, len(weights), flops, record_trajectory)
    metrics.update(measured)
    extra.update(more)
    return metrics, extra


def overrides(args: Any) -> dict[str, Any]:
    """The hyperparameters set by ``--epochs`` and ``--lr``."""
    return {k: v for k, v in {"epochs": args.epochs, "lr": args.lr}.items() if v is not None}


def tune(
    exp: Experiment,
    args: Any,
    gate: str,
    setting: Any,
    data: Splits,
    store: RunStore,
    progress: bool,
) -> dict[str, Any]:
    """Random grid search (Appendix D): ``--grid-points`` random grid points × ``--trials``
    runs, each a resumable ``phase="tune"`` record; ``--epochs`` and ``--lr`` fix their axes.
    Selection: the shared rule (:func:`dselectk_research.best.best_configuration`) over the
    points in their sampled order, each with its trials' validation metric (the experiment's
    ``select``: lowest weighted validation loss, or highest mean validation accuracy); a point
    with a diverged trial is ineligible, and so is one whose mean expected number of nonzeros
    is above 4 (Gumbel-softmax, as in the paper); none eligible: the quick defaults, metric
    NaN."""
    base_seed, data_cfg = args.seed, data.config
    grid = {**exp.grid[gate], **{k: [v] for k, v in overrides(args).items()}}
    seed = f"{exp.name}|{gate}|{json.dumps(setting)}|{base_seed}"
    pts = sample_points(grid_points(grid, sort_keys=True), int(args.grid_points), seed)
    metric = "val_loss" if exp.select == "min_loss" else "val_mean_accuracy"
    tried: list[tuple[int, list[Any]]] = []  # (point index, its trials' validation metrics)
    sparse: dict[int, bool] = {}  # point index -> mean expected nonzeros <= 4
    for i, point in enumerate(pts):
        hp = {**exp.quick_hparams[gate], **point}
        vals, nnz = [], []
        for trial in range(int(args.trials)):
            s = init_seed(base_seed, gate, setting, trial, f"tune{i}")
            cfg = record_config(exp, gate, setting, hp, trial, s, base_seed, data_cfg, "tune")
            path = store.path(run_id(cfg))
            if path.is_file():
                m = json.loads(path.read_text(encoding="utf-8"))["metrics"]
            else:
                desc = f"tune {gate} {i + 1}/{len(pts)} trial {trial + 1}"
                m, more = train_one(
                    exp, gate, hp, setting, s, data, progress=progress, record_trajectory=False,
                    desc=desc,
                )  # fmt: skip
                flag = {k: more[k] for k in ("diverged", "diverged_error") if k in more}
                store.save(cfg, m, **flag)
            vals.append(m.get(metric, math.nan))
            nnz.append(m.get("expected_nonzeros", 0.0))
        tried.append((i, vals))
        sparse[i] = float(np.mean(nnz)) <= 4.0  # only Gumbel-softmax has expected nonzeros
    choice = best_configuration(
        tried, maximize=exp.select != "min_loss", eligible=sparse.__getitem__
    )
    if choice.key is None:
        return {"hparams": dict(exp.quick_hparams[gate]), "val_metric": math.nan,
                "metric": metric, "points": len(pts)}  # fmt: skip
    best_hp = {**exp.quick_hparams[gate], **pts[choice.key]}
    return {"hparams": best_hp, "val_metric": choice.mean, "metric": metric, "points": len(pts)}
