"""Training of the synthetic study: R members trained as one vectorized model by the library's
training loop, and the paper's grid search (Appendix D) over such members."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dselectk.data.synthetic import SyntheticData
from dselectk.experiments.records import RunStore, run_id
from dselectk.experiments.runner import grid_points, progress_position, sample_points
from dselectk.experiments.synthetic.loss import mixture_loss
from dselectk.experiments.synthetic.model import SyntheticMoE, evaluate_model, schedulers
from dselectk.experiments.synthetic.spec import (
    BATCH_SIZE,
    K,
    init_seed,
    paper_grid,
    record_config,
    resolve_hparams,
    variant_of,
)
from dselectk.optim import RowwiseAdam
from dselectk.progress import tqdm
from dselectk.search import RefitStats, SwapSearch, selector_refit_mse
from dselectk.telemetry import RoutingTelemetry
from dselectk.training import Callback, History, TaskData, TrainConfig, train
from dselectk.variants import Variant

__all__ = ["train_reps", "tune"]


class _Checkpoints(Callback):
    """Evaluates every member after the checkpoint epochs."""

    def __init__(self, epochs: Sequence[int], data: SyntheticData) -> None:
        self.epochs = set(epochs)
        self.data = data
        self.results: dict[int, list[dict[str, float]]] = {}

    def on_epoch(self, model: nn.Module, epoch: int, history: History) -> None:
        if epoch in self.epochs:
            assert isinstance(model, SyntheticMoE)
            model.eval()
            self.results[epoch] = evaluate_model(model, self.data)
            model.train()


def _fused_loss(model: nn.Module, batch: TaskData) -> tuple[Tensor, None]:
    assert isinstance(model, SyntheticMoE)
    return mixture_loss(model, batch.x, batch.ys[0]), None


def _search(model: SyntheticMoE, data: SyntheticData, steps_total: int, seed: int) -> SwapSearch:
    """The swap search of the model's variant: each (repetition, task) gate scored by that
    task's MSE on a fixed probe of the training set."""
    plan = model.variant.search
    assert plan is not None
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(data.x_train.shape[0], generator=g)[: plan.probe]
    x, y = data.x_train[idx], data.y_train[idx, : model.num_tasks].T  # (B, p), (T, B)

    def member_loss() -> Tensor:
        pred, _ = model(x)  # (R, T, B)
        return ((pred - y) ** 2).mean(-1).flatten()

    if plan.refit:  # scored with the selector shares refitted (least squares)
        cache: dict[tuple[int, ...], RefitStats] = {}

        def member_loss() -> Tensor:
            # the experts' probe moments, recomputed only after an optimizer step changed them
            key = tuple(p._version for p in model.experts.parameters())
            if key not in cache:
                cache.clear()
                cache[key] = RefitStats.of(model.expert_outputs(x), y)
            return selector_refit_mse(model.gates, cache[key])

    return plan.callback(model.gates, member_loss, steps_total)


def train_reps(
    gate: str | Variant,
    num_tasks: int,
    hparams: Mapping[str, Any],
    init_seeds: Sequence[int],
    data: SyntheticData,
    *,
    shuffle_seed: int,
    checkpoints: Sequence[int] | None = None,
    progress: bool = False,
    desc: str = "",
    return_model: bool = False,
    member_hparams: Sequence[Mapping[str, Any]] | None = None,
    telemetry_dir: Path | None = None,
    num_experts: int | None = None,
    k: int = K,
) -> dict[int, list[dict[str, float]]] | tuple[dict[int, list[dict[str, float]]], SyntheticMoE]:
    """Train R repetitions together; return metrics per checkpoint epoch and repetition.

    Each step minimises Σ_r [Σ_t MSE_t,r + aux_r] (summed task losses, Appendix C.1) with the
    fused loss; the R repetitions share parameters with nothing, so this is R independent Adam
    runs (one :class:`~dselectk.optim.RowwiseAdam` when their learning rates differ).

    Args:
        gate: the variant (or its name).
        num_tasks: T (tasks 0..T-1 of the data, i.e. groups G1..G_{T/16}).
        hparams: lr, epochs and the gate's hyperparameters (:func:`resolve_hparams`).
        init_seeds: one per repetition.
        data: the data set.
        shuffle_seed: seed of the mini-batch order, shared by all repetitions.
        checkpoints: epochs after which to evaluate (default: the last only). Only meaningful
            for settings whose schedules do not depend on the total number of epochs.
        progress: show a progress bar (updated once per epoch).
        desc: progress bar label.
        return_model: also return the trained model.
        member_hparams: one mapping per seed overriding lr, epochs and the gate's
            hyperparameters for that member: different configurations trained as one model
            (used by :func:`tune`). Training runs for the largest ``epochs``; a member's
            annealing schedule spans its own epochs (evaluate it at its own epochs).
        telemetry_dir: log routing telemetry there once per epoch (binary S(Z), experts per
            task, selector collisions, ...; gate ``gates/task<r*T + t>`` is repetition r's
            task t).
        num_experts, k: the model's shape (default T/4 experts, k = 4).
    """
    v = variant_of(gate)
    if member_hparams is not None:
        for m in member_hparams:
            v.check_hparams(m, "member_hparams")
        epochs = max(int(m.get("epochs", hparams["epochs"])) for m in member_hparams)
    else:
        epochs = int(hparams["epochs"])
    cps = sorted(set(checkpoints or [epochs]))
    if cps[-1] > epochs or cps[0] < 1:
        raise ValueError(f"checkpoints must lie in [1, {epochs}], got {cps}")
    model = SyntheticMoE(
        v, num_tasks, hparams, init_seeds, member_hparams, num_experts=num_experts, k=k
    )
    steps_per_epoch = math.ceil(data.x_train.shape[0] / BATCH_SIZE)
    opt: torch.optim.Optimizer
    if member_hparams is None:
        opt = torch.optim.Adam(model.parameters(), lr=float(hparams["lr"]), foreach=True)
    else:
        opt = RowwiseAdam(model.parameters(), lr=model.member_values("lr"))
    evaluator = _Checkpoints(cps, data)
    callbacks: list[Any] = [evaluator]
    if telemetry_dir is not None:
        callbacks.append(RoutingTelemetry(telemetry_dir, every=steps_per_epoch))
    if v.search is not None:
        callbacks.append(_search(model, data, epochs * steps_per_epoch, shuffle_seed))
    config = TrainConfig.for_members(
        lr=float(hparams["lr"]),
        batch_size=BATCH_SIZE,
        epochs=epochs,
        shuffle_seed=shuffle_seed,
        progress=progress,
        desc=desc,
        position=progress_position(),
    )
    train(
        model,
        TaskData(data.x_train, [data.y_train[:, :num_tasks]]),
        None,
        config,
        schedulers=schedulers(model, hparams, epochs * steps_per_epoch, steps_per_epoch),
        optimizer=opt,
        callbacks=callbacks,
        loss_fn=_fused_loss,
    )
    if return_model:
        return evaluator.results, model
    return evaluator.results


Member = tuple[dict[str, Any], int, list[int]]  # (grid point, trial, epochs evaluated)


def tune(
    gate: str | Variant,
    num_tasks: int,
    data: SyntheticData,
    store: RunStore,
    *,
    grid: Mapping[str, Sequence[float]] | None = None,
    trials: int = 5,
    max_points: int | None = None,
    seed: int = 0,
    data_cfg: Mapping[str, Any],
    progress: bool = True,
    max_members: int = 200,
    shape: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Grid search of Appendix D for one variant and T; returns the selected hyperparameters.

    Every grid point (``grid``: the axes, default :func:`paper_grid`) is trained with
    ``trials`` fresh initialisations, and all (point, trial) pairs train together as the
    members of batched models of up to ``max_members`` members (per-member lr, γ, λ and
    temperature schedule; see :func:`train_reps`). For variants without schedules or search the
    epochs axis costs nothing extra: one run of max(epochs) is evaluated after each epoch count
    of the grid (an Adam run of 25 epochs is the first 25 epochs of a 100-epoch run with the
    same seeds); otherwise (a ramp or the search spans the run) epochs is one more grid axis.
    ``max_points`` samples that many grid points at random (random grid search); records
    already in ``store`` are not trained again. Selection: lowest mean validation MSE; for
    gates that binarize (DSelect-k), configurations whose S(Z) is not binary in every trial
    are discarded (Appendix D); if none is binary, the best non-binary one is returned with
    ``"binary": False``. ``shape``: ``num_experts`` and ``k`` of the model (default T/4, 4).
    """
    v = variant_of(gate)
    axes = dict(paper_grid(v) if grid is None else grid)
    epochs_axis = [int(e) for e in axes.pop("epochs")]
    points = grid_points(axes)
    for p in points:
        v.check_hparams(p, "grid")
    epoch_dependent = bool(v.schedules) or v.search is not None
    if epoch_dependent:
        points = [{**p, "epochs": e} for p in points for e in epochs_axis]
    points = sample_points(points, max_points, f"{seed}-{v.name}-{num_tasks}")
    seeds = [init_seed(seed, v.name, num_tasks, 10_000 + i) for i in range(trials)]
    base = resolve_hparams(v, num_tasks, {}, {})
    shape = dict(shape or {"num_experts": num_tasks // 4, "k": K})

    def config(p: Mapping[str, Any], e: int, i: int) -> dict[str, Any]:
        hp = {**base, **p, "epochs": e}
        return record_config(v, num_tasks, hp, i, seeds[i], seed, data_cfg, "tune", shape)

    members: list[Member] = []
    planned: set[str] = set()  # this search's runs: records of other settings are not scored
    for p in points:
        eps = [int(p["epochs"])] if epoch_dependent else epochs_axis
        for i in range(trials):
            cfgs = [config(p, e, i) for e in eps]
            planned.update(run_id(c) for c in cfgs)
            if not all(store.done(c) for c in cfgs):
                members.append((p, i, eps))
    # ramps and the search plan are fractions of the batch's steps: the members of such a
    # variant are batched by epoch count (the others share batches freely)
    by_epochs: dict[int, list[Member]] = {}
    for m in members:
        by_epochs.setdefault(max(m[2]) if epoch_dependent else 0, []).append(m)
    chunks = [
        group[i : i + max_members]
        for group in by_epochs.values()
        for i in range(0, len(group), max_members)
    ]
    in_worker = progress_position() is not None  # one bar line per worker: epochs only
    label = f"tune {v.name} T={num_tasks}"
    bar = tqdm(chunks, disable=not progress or in_worker, desc=label, unit="batch")
    for chunk in bar:
        bar.set_postfix(configs=len(chunk))
        cps = sorted({e for _, _, eps in chunk for e in eps})
        res = train_reps(
            v,
            num_tasks,
            {**base, "epochs": max(cps)},
            [seeds[i] for _, i, _ in chunk],
            data,
            shuffle_seed=seed,
            checkpoints=cps,
            member_hparams=[{**p, "epochs": max(eps)} for p, _, eps in chunk],
            progress=progress,
            desc=f"{label}: {len(chunk)} configs",
            num_experts=shape["num_experts"],
            k=shape["k"],
        )
        assert isinstance(res, dict)
        for j, (p, i, eps) in enumerate(chunk):
            for e in eps:
                store.save(config(p, e, i), res[e][j])
    scores: dict[str, tuple[float, bool, dict[str, Any]]] = {}
    for rec in store.load():
        if rec.get("run_id") not in planned:
            continue
        c = rec["config"]
        key = json.dumps(c["hparams"], sort_keys=True)
        m = rec["metrics"]
        prev = scores.get(key, (0.0, True, {"n": 0}))
        n = prev[2]["n"] + 1
        binary = prev[1] and bool(m.get("all_binary", 1.0))  # gates that binarize only
        val = m.get("val_mse")  # a diverged trial (NaN, saved as null) makes its config inf
        val = float(val) if isinstance(val, (int, float)) and math.isfinite(val) else math.inf
        scores[key] = (prev[0] + val, binary, {"n": n, "hparams": c["hparams"]})
    ranked = sorted(scores.values(), key=lambda s: s[0] / s[2]["n"])
    finite = [s for s in ranked if math.isfinite(s[0])] or ranked
    best = ([s for s in finite if s[1]] or finite)[0]
    return {
        "hparams": best[2]["hparams"],
        "val_mse": best[0] / best[2]["n"],
        "binary": bool(best[1]),
        "configs_tried": len(scores),
        "configs_binary": sum(1 for s in scores.values() if s[1]),
        "configs_diverged": sum(1 for s in scores.values() if not math.isfinite(s[0])),
    }
