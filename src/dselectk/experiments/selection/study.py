"""The selection study's arms, protocol, data and cells (one cell = one arm at one shape)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

import torch

from dselectk.experiments.records import RunStore, run_id
from dselectk.experiments.recovery import VARIANTS, RecoveryData, train_reps
from dselectk.experiments.recovery.model import BATCH_SIZE, FEATURES, UNITS, expert_outputs
from dselectk.experiments.recovery.recipe import tuned_hparams
from dselectk.experiments.runner import missing
from dselectk.gates.base import Gate
from dselectk.search import SwapSearch
from dselectk.variants import SearchPlan, Variant, variant_table

EXPERIMENT = "selection"
#: data seeds of this study: 9000 + 10·experts + true (all inside the reserved range 9000-9999;
#: no development run of the package used a seed there). Test inputs: seed 10000 + data seed.
SEED_RANGE = (9000, 9999)
STUDY_SEED = 9000  # base of the init and shuffling seeds (the same for every arm)
N_TRAIN, N_VAL, N_TEST = 10_000, 10_000, 10_000
QUICK_SHAPES = ((16, 2), (16, 4), (32, 3))
FULL_SHAPES = tuple((n, t) for n in (16, 32, 64) for t in (2, 3, 4, 6) if t <= n // 4)
QUICK_LRS, FULL_LRS = (1e-1, 1e-2, 1e-3), (1e-1, 1e-2, 1e-3, 1e-4, 1e-5)
QUICK_REPS, FULL_REPS = 8, 100

#: searches started by a CountedPlan in this process (probe passes are read from them)
_SEARCHES: list[SwapSearch] = []


@dataclass(frozen=True)
class CountedPlan(SearchPlan):
    """The recovery study's search plan; its callbacks are kept so that the probe passes
    (candidate evaluations; each scores every repetition on the probe) can be counted."""

    def callback(self, gate: Gate, member_loss: Any, total_steps: int) -> SwapSearch:
        cb = super().callback(gate, member_loss, total_steps)
        _SEARCHES.append(cb)
        return cb


@dataclass(frozen=True)
class FrozenGateVariant(Variant):
    """A variant whose gate parameters do not train (requires_grad False): the optimizer
    (one learning rate per repetition, shared by gate and head) never sees them, so only the
    swap search moves the selection; the head still trains at the arm's learning rate."""

    def build(self, num_experts: int, *, hparams: Any = None, **structure: Any) -> Gate:
        gate = super().build(num_experts, hparams=hparams, **structure)
        gate.requires_grad_(False)
        return gate

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "gate_frozen": True}


def _counted(v: Variant) -> Variant:
    assert v.search is not None
    s = v.search
    return replace(v, search=CountedPlan(s.at, s.binarize, s.refit, s.probe))


_DSK_SEARCH = _counted(VARIANTS["dselect_k_search"])
#: the arms, in report order; "search" says whether the swap search (refit scoring) runs
ARMS = variant_table(
    VARIANTS["dselect_k"],
    VARIANTS["topk"],
    VARIANTS["comet"],
    _DSK_SEARCH,
    _counted(VARIANTS["topk_search"]),
    FrozenGateVariant(
        "search_only", "dselect_k", "search only (DSelect-k's gate frozen at init) + swap search",
        _DSK_SEARCH.options, search=_DSK_SEARCH.search, tuned_as="dselect_k",
    ),
)  # fmt: skip
BASELINES = ("dselect_k", "topk", "comet")
#: COMET's tree gate has no discrete selection to search (Gate.searchable False): no COMET +
#: search arm.
NOT_RUN = {"comet + search": "COMET's gate is not searchable (dselectk.search refuses it)"}


def _protocol() -> str:
    """The protocol: the head of ``templates/selection.md`` (above ``<!-- results -->``),
    filled with this module's constants; printed before any run and atop every report."""
    text = resources.files("dselectk.experiments.templates").joinpath("selection.md")
    head = text.read_text(encoding="utf-8").split("<!-- results -->")[0]
    return Template(head).substitute(
        arms=", ".join(f"`{a}`" for a in ARMS), not_run=NOT_RUN["comet + search"],
        quick_lrs=list(QUICK_LRS), full_lrs=list(FULL_LRS), n_test=f"{N_TEST:,}",
        seed_lo=SEED_RANGE[0], seed_hi=SEED_RANGE[1], probe=SearchPlan.probe,
    ).strip()  # fmt: skip


PROTOCOL = _protocol()


def data_seed(experts: int, true: int) -> int:
    seed = STUDY_SEED + 10 * experts + true
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"shape {experts}/{true}: data seed {seed} outside {SEED_RANGE}")
    return seed


def init_seed(rep: int) -> int:
    """Repetition r's init seed: the same for every arm, shape and learning rate (paired)."""
    return (STUDY_SEED * 1_000_003 + rep * 7919 + 17) % 2**31


class HeldOutData:
    """Recovery's data of a seed with the validation inputs replaced by a test set drawn from
    the same generating model (the same true experts, head and bias)."""

    def __init__(self, base: RecoveryData, n_test: int = N_TEST) -> None:
        g = torch.Generator().manual_seed(base.seed)  # recovery's draws, in its order
        true = torch.randn(base.num_true, FEATURES, UNITS, generator=g)
        head = torch.randn(UNITS, generator=g)
        assert torch.equal(true, base.true_experts), "recovery's generator changed"
        x_all = torch.cat([base.x_train, base.x_val])
        bias = (expert_outputs(x_all, true).mean(0) @ head).median()
        x = torch.randn(
            n_test, FEATURES, generator=torch.Generator().manual_seed(10_000 + base.seed)
        )
        self.labels = lambda xs: ((expert_outputs(xs, true).mean(0) @ head - bias) > 0).float()
        self.x_train, self.y_train = base.x_train, base.y_train
        self.x_val, self.y_val = x, self.labels(x)
        self.true_experts, self.seed, self.num_true = base.true_experts, base.seed, base.num_true


@dataclass(frozen=True)
class SelectionConfig:
    """What a ``reproduce selection`` command computes."""

    out: Path
    arms: tuple[str, ...] = tuple(ARMS)
    shapes: tuple[tuple[int, int], ...] = QUICK_SHAPES
    reps: int = QUICK_REPS
    lrs: tuple[float, ...] = QUICK_LRS
    epochs: int | None = None

    def __post_init__(self) -> None:
        for n, t in self.shapes:
            if not 1 <= t <= n // 4:
                raise ValueError(f"argument --shapes: {n}/{t}: need 1 <= true <= experts/4")
            data_seed(n, t)
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"argument --arms: unknown {unknown}; choose from {list(ARMS)}")


def cells(config: SelectionConfig) -> list[tuple[str, int, int]]:
    return [(a, n, t) for n, t in config.shapes for a in config.arms]


def cell_name(cell: tuple[str, int, int]) -> str:
    return f"{cell[0]}/{cell[1]}x{cell[2]}"


def _hparams(config: SelectionConfig, arm: Variant) -> dict[str, Any]:
    hp = tuned_hparams(arm)
    if config.epochs is not None:
        hp["epochs"] = config.epochs
    return hp


def _record(arm: str, shape: tuple[int, int], hp: dict, lr: float, rep: int, phase: str) -> dict:
    n, t = shape
    return {
        "experiment": EXPERIMENT, "phase": phase, "arm": arm, "variant": ARMS[arm].identity(),
        "shape": {"experts": n, "true": t, "k": t}, "lr": float(lr),
        "hparams": dict(sorted(hp.items())), "rep": rep, "init_seed": init_seed(rep),
        "shuffle_seed": STUDY_SEED, "data_seed": data_seed(n, t),
        "data": {"n_train": N_TRAIN, "n_val": N_VAL, "n_test": N_TEST if phase == "test" else 0},
    }  # fmt: skip


def _train(arm: Variant, hp: dict, data: Any, jobs: list, shape: tuple[int, int], desc: str,
           progress: bool) -> list[dict[str, float]]:  # fmt: skip
    _SEARCHES.clear()
    metrics, _ = train_reps(
        arm, {**hp, "lr": float(jobs[0][0])}, data, [init_seed(r) for _, r in jobs],
        shuffle_seed=STUDY_SEED, experts=shape[0], k=shape[1], lrs=[lr for lr, _ in jobs],
        record_every=0, progress=progress, desc=desc,
    )  # fmt: skip
    passes = sum(res.evaluations for s in _SEARCHES for res in s.results)
    _SEARCHES.clear()
    steps = int(hp["epochs"]) * math.ceil(N_TRAIN / BATCH_SIZE)
    for m in metrics:
        m["probe_passes"] = float(passes)  # every candidate evaluation scores every member
        m["probe_share"] = passes * SearchPlan.probe / (steps * BATCH_SIZE)
    return metrics


def run_cell(
    config: SelectionConfig, cell: tuple[str, int, int], data: Any, progress: bool
) -> dict:
    """Tune (every lr × repetition, validation loss), then retrain the selected lr and
    evaluate it once on the test set."""
    name, n, t = cell
    arm, store, shape = ARMS[name], RunStore(config.out), (n, t)
    base = RecoveryData(data_seed(n, t), N_TRAIN, N_VAL, num_true=t)
    hp = _hparams(config, arm)
    jobs = [(lr, r) for lr in config.lrs for r in range(config.reps)]
    cfgs = [_record(name, shape, hp, lr, r, "tune") for lr, r in jobs]
    todo = missing(store, cfgs)
    if todo:
        ms = _train(
            arm, hp, base, [jobs[i] for i in todo], shape, f"{cell_name(cell)} tune", progress
        )
        for m, i in zip(ms, todo):
            store.save(cfgs[i], m)
    loss: dict[float, list[float]] = {}
    for c in cfgs:
        rec = json.loads(store.path(run_id(c)).read_text(encoding="utf-8"))
        loss.setdefault(c["lr"], []).append(rec["metrics"]["val_loss"])
    mean = {v: sum(ls) / len(ls) for v, ls in loss.items()}
    lr = min(loss, key=lambda v: (mean[v] if math.isfinite(mean[v]) else math.inf, v))
    tests = [_record(name, shape, hp, lr, r, "test") for r in range(config.reps)]
    todo = missing(store, tests)
    if todo:
        test = HeldOutData(base)
        ms = _train(
            arm, hp, test, [(lr, r) for r in todo], shape, f"{cell_name(cell)} test", progress
        )
        for m, i in zip(ms, todo):
            m = {k.replace("val_", "test_"): v for k, v in m.items()}
            store.save(tests[i], m)
    return {"lr": lr, "lrs": list(config.lrs), "rule": "lowest mean validation loss"}
