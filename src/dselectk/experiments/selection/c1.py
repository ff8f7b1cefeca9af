"""The selection study's Appendix C.1 cells: T related regression tasks (groups of 16 sharing 4
generating experts), T/4 trainable experts, one static gate per task choosing k = 4.

Each (arm, T) cell is tuned on VALIDATION over the paper's grid (lr, epochs and the gate's γ/λ;
Appendix D) by :func:`dselectk.experiments.synthetic.train.tune` with the test split replaced
by the validation split (so tuning never reads it), then the selected configuration is trained
again for ``reps`` repetitions with the study's paired init seeds and read once on the TEST
split. Every arm of the cell sees the same data (one data seed from the reserved range)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, replace
from typing import Any

from dselectk.data.synthetic import SyntheticData, generate_data
from dselectk.experiments.records import RunStore
from dselectk.experiments.runner import missing
from dselectk.experiments.synthetic.spec import BATCH_SIZE, K
from dselectk.experiments.synthetic.spec import VARIANTS as C1_VARIANTS
from dselectk.experiments.synthetic.train import train_reps, tune
from dselectk.variants import SearchPlan, Variant

__all__ = ["DATA_SEED", "FULL", "QUICK", "C1Sizes", "K", "arms", "data_cfg", "load", "run_c1_cell"]

#: the C.1 data seed of this study (reserved range 9000-9999; no development run used it)
DATA_SEED = 9700
#: the grid's epoch counts (Appendix D); the no-search arms evaluate all of them from one run
EPOCHS_AXIS = 4


@dataclass(frozen=True)
class C1Sizes:
    """Split sizes, tuning effort and repetitions of the C.1 cells."""

    n_train: int
    n_val: int
    n_test: int
    points: int | None  # configurations of the gate's axes sampled per arm (None: every one)
    trials: int  # initialisations per configuration in tuning
    reps: int  # repetitions of the selected configuration (paired across arms)


QUICK = C1Sizes(20_000, 10_000, 10_000, points=4, trials=2, reps=6)
FULL = C1Sizes(100_000, 20_000, 20_000, points=None, trials=5, reps=25)  # the paper's splits


def arms(recovery_arms: dict[str, Variant], counted: Any) -> dict[str, Variant]:
    """The C.1 form of each arm (the same names as recovery's): C.1's search plans (refit
    scoring; the swap search at recovery's fractions), counted; ``search_only`` freezes the
    selection as in recovery."""
    search = counted(C1_VARIANTS["dselect_k_search"])
    table = {
        "dselect_k": C1_VARIANTS["dselect_k"],
        "topk": C1_VARIANTS["topk"],
        "comet": recovery_arms["comet"],
        "dselect_k_search": search,
        "topk_search": counted(replace(C1_VARIANTS["topk_search_refit"], name="topk_search")),
        "search_only": replace(recovery_arms["search_only"], search=search.search),
    }
    return {name: table[name] for name in recovery_arms if name in table}


def load(sizes: C1Sizes) -> SyntheticData:
    """The study's C.1 data (all 128 tasks; a cell of T tasks uses the first T)."""
    return generate_data(DATA_SEED, sizes.n_train, sizes.n_val, sizes.n_test)


def data_cfg(sizes: C1Sizes) -> dict[str, Any]:
    return {"study": "selection", "seed": DATA_SEED, "n_train": sizes.n_train,
            "n_val": sizes.n_val, "n_test": sizes.n_test}  # fmt: skip


def run_c1_cell(
    arm: Variant, num_tasks: int, data: SyntheticData, sizes: C1Sizes, store: RunStore, *,
    init_seed: Any, study_seed: int, record: Any, train_counted: Any, progress: bool,
) -> dict[str, Any]:  # fmt: skip
    """Tune ``arm`` at T = ``num_tasks`` on validation, then retrain the selection ``reps``
    times and evaluate it once on the test split; returns the selection."""
    shape = {"num_experts": num_tasks // 4, "k": K}
    epoch_dependent = bool(arm.schedules) or arm.search is not None
    per_config = EPOCHS_AXIS if epoch_dependent else 1
    points = None if sizes.points is None else sizes.points * per_config
    no_test = dataclasses.replace(data, x_test=data.x_val, y_test=data.y_val)
    selected = tune(
        arm, num_tasks, no_test, store, trials=sizes.trials, max_points=points, seed=study_seed,
        data_cfg=data_cfg(sizes), progress=progress, shape=shape,
    )  # fmt: skip
    hp = dict(selected["hparams"])
    cfgs = [record(hp, r) for r in range(sizes.reps)]
    todo = missing(store, cfgs)
    if todo:
        results, passes = train_counted(
            lambda: train_reps(
                arm, num_tasks, hp, [init_seed(r) for r in todo], data, shuffle_seed=study_seed,
                progress=progress, desc=f"{arm.name}/c1-T{num_tasks} test",
                num_experts=shape["num_experts"], k=shape["k"],
            )
        )  # fmt: skip
        steps = int(hp["epochs"]) * math.ceil(sizes.n_train / BATCH_SIZE)
        for m, i in zip(results[int(hp["epochs"])], todo, strict=True):
            m["probe_passes"] = float(passes)
            m["probe_share"] = passes * SearchPlan.probe / (steps * BATCH_SIZE)
            store.save(cfgs[i], m)
    return {**selected, "hparams": json.loads(json.dumps(hp)), "rule": "lowest mean validation "
            "MSE over the trials (binary configurations first, Appendix D)"}  # fmt: skip
