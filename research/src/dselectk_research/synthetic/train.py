"""The C.1 model and its training: R members (repetitions, or the configurations of the grid
search) as one :class:`~dselectk.models.MoEBank`, trained by the library's loop, and the paper's
grid search (Appendix D) over such members."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dselectk.layers import StackedMLP
from dselectk.members import build_bank, per_gate_hparams, train_bank
from dselectk.models import MoEBank
from dselectk.progress import tqdm
from dselectk.telemetry import RoutingTelemetry
from dselectk.training import Callback, History, TaskData
from dselectk.variants import Variant
from dselectk_research.best import best_configuration
from dselectk_research.data.synthetic import FEATURES, UNITS, SyntheticData
from dselectk_research.executors import progress_position
from dselectk_research.metrics import distinct_experts, pairwise_jaccard
from dselectk_research.records import RunStore, run_id
from dselectk_research.runner import grid_points, sample_points
from dselectk_research.synthetic.spec import (
    BATCH_SIZE,
    K,
    init_seed,
    paper_grid,
    record_config,
    resolve_hparams,
    variant_of,
)


def build_model(
    gate: str | Variant,
    num_tasks: int,
    hparams: Mapping[str, Any],
    init_seeds: Sequence[int],
    member_hparams: Sequence[Mapping[str, Any]] | None = None,
    *,
    num_experts: int | None = None,
    k: int = K,
) -> MoEBank:
    """R multi-gate MoEs of Appendix C.1 as one bank (:func:`~dselectk.members.build_bank`): E
    experts of the generator's form (``num_experts``, default T/4) and one static gate per task
    choosing ``k``. Member r's parameters are those a single model built under
    ``torch.manual_seed(init_seeds[r])`` gets; its hyperparameters are ``hparams`` updated by
    ``member_hparams[r]`` (when given; the bank's gates then hold one value per gate)."""
    v = variant_of(gate)
    if num_experts is None and num_tasks % 4:
        raise ValueError(f"num_tasks must be a multiple of 4, got {num_tasks}")
    reps, e = len(init_seeds), num_tasks // 4 if num_experts is None else num_experts
    keys = paper_grid(v)  # the hyperparameters the study gives this variant
    members = [{**hparams, **m} for m in member_hparams or [{}] * reps]
    own = [{n: x for n, x in hp.items() if n in keys} for hp in members]
    bank_hp: Mapping[str, Any] = {n: x for n, x in hparams.items() if n in keys}
    if member_hparams is not None:  # per-gate values: member r's, over its T gates
        bank_hp = per_gate_hparams(own, num_tasks, list(keys))

    def make(r: int | None) -> MoEBank:  # member r alone, or the bank (r None)
        n, hp = (reps, bank_hp) if r is None else (1, own[r])
        experts = StackedMLP(n * e, FEATURES, [UNITS], final_activation=True)
        return MoEBank(experts, v.build(e, hparams=hp, k=k, num_gates=n * num_tasks), n)

    return build_bank(make, init_seeds)


@torch.no_grad()
def evaluate_model(model: MoEBank, data: SyntheticData, k: int = K) -> list[dict[str, float]]:
    """Metrics of each member: MSEs, Jaccard indices, experts per task, binarization."""
    t = model.num_tasks
    w = model.inference_weights()
    yt = data.y_test[:, :t]
    sel = w > 0
    rel, unrel = pairwise_jaccard(sel, data.groups[:t])
    nsel = distinct_experts(sel).double()  # (R, T)
    cols = {
        "val_mse": model.mse(data.x_val, data.y_val[:, :t], w),
        "test_mse": model.mse(data.x_test, yt, w),
        "related_jaccard": rel,
        "unrelated_jaccard": unrel,
        "experts_per_task": nsel.mean(1),
        "experts_per_task_min": nsel.amin(1),
        "experts_per_task_max": nsel.amax(1),
        "frac_tasks_k_experts": (nsel == k).double().mean(1),
    }
    if model.gates.posthoc_inference:  # the ablations: their own soft weights, too
        cols["test_mse_soft"] = model.mse(data.x_test, yt, model.expert_weights())
    if model.gates.binarizes:  # DSelect-k: which bits of S(Z) are exactly 0 or 1
        is_bin = model.gates.binary_entries().view(model.members, t, -1)
        task_binary = is_bin.flatten(2).float().mean(-1) == 1  # (R, T)
        cols["frac_binary_entries"] = is_bin.flatten(1).float().mean(-1)
        cols["frac_tasks_binary"] = task_binary.double().mean(-1)
        cols["all_binary"] = task_binary.all(-1).double()
    return [{name: float(c[r]) for name, c in cols.items()} for r in range(model.members)]


class _Checkpoints(Callback):
    """Evaluates every member after the checkpoint epochs."""

    def __init__(self, epochs: Sequence[int], data: SyntheticData, k: int) -> None:
        self.epochs, self.data, self.k = set(epochs), data, k
        self.results: dict[int, list[dict[str, float]]] = {}

    def on_epoch(self, model: nn.Module, epoch: int, history: History) -> None:
        if epoch in self.epochs:
            assert isinstance(model, MoEBank)
            model.eval()
            self.results[epoch] = evaluate_model(model, self.data, self.k)
            model.train()


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
) -> dict[int, list[dict[str, float]]] | tuple[dict[int, list[dict[str, float]]], MoEBank]:
    """Train R repetitions together (the same mini-batches, nothing shared: R independent Adam
    runs, one :class:`~dselectk.optim.RowwiseAdam` when their learning rates differ) and return
    each one's metrics after each of the ``checkpoints`` epochs (default: the last only).

    ``member_hparams``: one mapping per seed overriding ``hparams`` (lr, epochs, the gate's)
    for that member, so that different configurations train as one model (:func:`tune`); the
    run lasts the largest ``epochs`` and a member's annealing spans its own epochs.
    ``telemetry_dir``: log routing telemetry there once per epoch (gate ``gates/task<r*T + t>``
    is repetition r's task t).
    """
    v = variant_of(gate)
    for m in member_hparams or []:
        v.check_hparams(m, "member_hparams")
    members = [{**hparams, **m} for m in member_hparams or [{}]]
    epochs = max(int(m["epochs"]) for m in members)
    cps = sorted(set(checkpoints or [epochs]))
    if cps[-1] > epochs or cps[0] < 1:
        raise ValueError(f"checkpoints must lie in [1, {epochs}], got {cps}")
    model = build_model(
        v, num_tasks, hparams, init_seeds, member_hparams, num_experts=num_experts, k=k
    )
    evaluator = _Checkpoints(cps, data, k)
    callbacks: list[Any] = [evaluator]
    if telemetry_dir is not None:
        every = math.ceil(data.x_train.shape[0] / BATCH_SIZE)  # once per epoch
        callbacks.append(RoutingTelemetry(telemetry_dir, every=every))
    train_bank(
        model,
        TaskData(data.x_train, [data.y_train[:, :num_tasks]]),
        hparams,
        member_hparams=member_hparams,
        variant=v,
        batch_size=BATCH_SIZE,
        shuffle_seed=shuffle_seed,
        callbacks=callbacks,
        progress=progress,
        desc=desc,
        position=progress_position(),
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

    Every point of ``grid`` (default :func:`paper_grid`) is trained from ``trials``
    initialisations, all (point, trial) pairs as the members of batched models of up to
    ``max_members``. Without schedules or search, one run of max(epochs) is evaluated at each
    epoch count of the grid; otherwise epochs is one more axis. ``max_points`` samples that many
    points; runs already in ``store`` are not trained again. Selection: the shared rule
    (:func:`dselectk_research.best.best_configuration`): lowest mean validation MSE over the
    trials, a configuration with a diverged trial ineligible, among the configurations whose
    S(Z) is binary in every trial for gates that binarize (Appendix D; if none is, the best
    non-binary one, ``"binary": False``).
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

    # ramps and the search plan are fractions of the batch's steps: the members of such a
    # variant are batched by epoch count (the others share batches freely)
    by_epochs: dict[int, list[Member]] = {}  # the (point, trial) pairs not trained yet
    planned: set[str] = set()  # this search's runs: records of other settings are not scored
    for p in points:
        eps = [int(p["epochs"])] if epoch_dependent else epochs_axis
        for i in range(trials):
            cfgs = [config(p, e, i) for e in eps]
            planned.update(run_id(c) for c in cfgs)
            if not all(store.done(c) for c in cfgs):
                by_epochs.setdefault(max(eps) if epoch_dependent else 0, []).append((p, i, eps))
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
    trials_of: dict[str, list[dict[str, Any]]] = {}  # configuration -> its trials' metrics
    for rec in store.load():
        if rec.get("run_id") in planned:
            key = json.dumps(rec["config"]["hparams"], sort_keys=True)
            trials_of.setdefault(key, []).append(rec["metrics"])

    # the shared rule (dselectk_research.best): the configurations in the order of their
    # records (by run id), each with its trials' validation MSEs; a configuration with a
    # diverged trial is ineligible; binary in every trial preferred (gates that binarize;
    # Appendix D); every configuration diverged: the first, its validation MSE infinite
    keys = list(trials_of)
    binary = {k: all(bool(m.get("all_binary", 1.0)) for m in trials_of[k]) for k in keys}
    choice = best_configuration(
        ((k, [m.get("val_mse") for m in trials_of[k]]) for k in keys), prefer=binary.__getitem__
    )
    best = keys[0] if choice.key is None else choice.key
    return {
        "hparams": json.loads(best),
        "val_mse": math.inf if choice.key is None else choice.mean,
        "binary": binary[best],
        "configs_tried": len(keys),
        "configs_binary": choice.preferred_count,
        "configs_diverged": len(choice.diverged),
    }
