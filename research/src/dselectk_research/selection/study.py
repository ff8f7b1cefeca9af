"""The selection study's arms, protocol, data and cells (one cell = one arm at one shape: a
recovery shape, or Appendix C.1 at T tasks).

C.1 cells: T related regression tasks (groups of 16 sharing 4 generating experts), T/4 trainable
experts, one static gate per task choosing k = 4. Each (arm, T) is tuned on VALIDATION over the
paper's grid (lr, epochs and the gate's γ/λ; Appendix D) by
:func:`dselectk_research.synthetic.tune` with the test split replaced by the validation
split (so tuning never reads it), then the selection is trained again for ``reps`` repetitions
with the study's paired init seeds and read once on the TEST split. Every arm of a cell sees the
same data (one data seed from the reserved range)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from string import Template
from typing import TYPE_CHECKING, Any

from dselectk.gates.base import Gate
from dselectk.search import SwapSearch
from dselectk.variants import SearchPlan, Variant, total_steps
from dselectk_research.best import RULE, best_configuration
from dselectk_research.catalog import select
from dselectk_research.data.recovery import RecoveryData
from dselectk_research.data.synthetic import SyntheticData, generate_data
from dselectk_research.records import RunStore, diverged, read_record, run_id
from dselectk_research.recovery import BATCH_SIZE, train_reps, tuned_hparams
from dselectk_research.recovery import VARIANTS as RECOVERY_VARIANTS
from dselectk_research.recovery import init_seed as recovery_init_seed
from dselectk_research.recovery.report import FINITE as RECOVERY_FINITE
from dselectk_research.runner import missing
from dselectk_research.synthetic import BATCH_SIZE as C1_BATCH
from dselectk_research.synthetic import VARIANTS as C1_VARIANTS
from dselectk_research.synthetic import K as C1_K
from dselectk_research.synthetic import train_reps as c1_train_reps
from dselectk_research.synthetic import tune as c1_tune

if TYPE_CHECKING:
    from dselectk_research.selection.recipe import SelectionConfig

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
QUICK_TASKS, FULL_TASKS = (32, 64), (32, 64, 128)  # Appendix C.1's T
#: the C.1 data seed of this study (reserved range 9000-9999; no development run used it)
C1_DATA_SEED = 9700
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


C1_QUICK = C1Sizes(20_000, 10_000, 10_000, points=4, trials=2, reps=6)
C1_FULL = C1Sizes(100_000, 20_000, 20_000, points=None, trials=5, reps=25)  # the paper's splits


@dataclass(frozen=True)
class CountedPlan(SearchPlan):
    """A search plan that keeps the searches it starts in ``searches``, so that their probe
    passes (candidate evaluations; each scores every repetition on the probe) can be counted.
    One is made per training (:func:`_counting`); the record identity is the plan's."""

    searches: list[SwapSearch] = field(default_factory=list, compare=False, repr=False)

    def callback(self, gate: Gate, member_loss: Any, total_steps: int) -> SwapSearch:
        cb = super().callback(gate, member_loss, total_steps)
        self.searches.append(cb)
        return cb


def _arms(*names: str, labels: dict[str, str]) -> dict[str, Variant]:
    """The catalog's rows ``names`` (:mod:`dselectk_research.catalog`), labelled as ``labels``
    says."""
    return select(*names, labels=labels)


#: the arms, in report order: recovery's variants (its labels), the equal-budget arms and the
#: search-only arm (DSelect-k's selection frozen at init)
ARMS = _arms(
    "dselect_k", "topk", "comet", "topk_budget", "comet_budget", "dselect_k_search",
    "topk_search", "search_only",
    labels={"dselect_k_search": RECOVERY_VARIANTS["dselect_k_search"].label},
)  # fmt: skip
BASELINES = tuple(a for a, v in ARMS.items() if v.search is None)
BUDGET_ARMS = tuple(a for a in BASELINES if a.endswith("_budget"))
SEARCH_ARMS = tuple(a for a, v in ARMS.items() if v.search is not None)
#: the arms of the C.1 cells, by the same names and search plans (refit scoring, the swap
#: search at recovery's fractions), labelled as the synthetic study labels them; the budget
#: arms are recovery's only: C.1's no-search arms are tuned over epochs up to 100 already, see
#: the protocol
C1_ARMS = _arms(
    "dselect_k", "topk", "comet", "dselect_k_search", "topk_search", "search_only",
    labels={"topk_search": C1_VARIANTS["topk_search_refit"].label},
)  # fmt: skip
#: COMET's tree gate has no discrete selection to search (Gate.searchable False): no COMET +
#: search arm.
NOT_RUN = "COMET's gate is not searchable (dselectk.search refuses it)"


def max_probe_passes(arm: Variant, n: int, k: int) -> int:
    """Upper bound of a run's probe passes: per search, 1 + sweeps (2) × k selectors × n."""
    plan = arm.search
    if plan is None:
        return 0
    searches = len(set(plan.at) | ({plan.binarize} if plan.binarize else set()))
    return searches * (1 + 2 * k * n)


def budget_epochs(epochs: int, n: int, k: int) -> int:
    """Epochs of an equal-budget arm at shape n/k: ``epochs`` plus the largest search arm's
    probe examples (upper bound, :func:`max_probe_passes` × the probe size) as training epochs,
    rounded up. A probe example costs a forward of the mixture on precomputed expert outputs,
    a training example a forward, a backward and an optimizer step: the charge favours the
    no-search arms."""
    probe = max(max_probe_passes(ARMS[a], n, k) for a in SEARCH_ARMS) * SearchPlan.probe
    return epochs + math.ceil(probe / N_TRAIN)


def _sizes_text(z: C1Sizes) -> str:
    points = "every configuration" if z.points is None else f"{z.points} random configurations"
    return (
        f"{z.n_train:,}/{z.n_val:,}/{z.n_test:,} train/validation/test examples, {points} "
        f"of the gate's axes per arm, {z.trials} trials each, {z.reps} test repetitions"
    )


def template(part: int) -> Template:
    """Part 0 (the protocol) or 1 (the results) of ``templates/selection.md``, split at
    ``<!-- results -->``."""
    text = resources.files("dselectk_research.templates").joinpath("selection.md")
    return Template(text.read_text(encoding="utf-8").split("<!-- results -->")[part])


def _protocol() -> str:
    """The protocol: the head of the template filled with this module's constants; printed
    before any run and atop every report."""
    return template(0).substitute(
        arms=", ".join(f"`{a}`" for a in ARMS), not_run=NOT_RUN,
        c1_seed=C1_DATA_SEED, quick_tasks=list(QUICK_TASKS), full_tasks=list(FULL_TASKS),
        budget=", ".join(f"{n}/{t}: {budget_epochs(50, n, t)}" for n, t in FULL_SHAPES),
        c1_quick=_sizes_text(C1_QUICK), c1_full=_sizes_text(C1_FULL),
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
    return recovery_init_seed(STUDY_SEED, rep)


def load_c1(sizes: C1Sizes) -> SyntheticData:
    """The study's C.1 data (all 128 tasks; a cell of T tasks uses the first T)."""
    return generate_data(C1_DATA_SEED, sizes.n_train, sizes.n_val, sizes.n_test)


class HeldOutData:
    """Recovery's data of a seed with the validation inputs replaced by a test set drawn from
    the same generating model (:meth:`RecoveryData.held_out`; inputs seeded 10000 + seed)."""

    def __init__(self, base: RecoveryData, n_test: int = N_TEST) -> None:
        self.labels = base.labels
        self.x_train, self.y_train = base.x_train, base.y_train
        self.x_val, self.y_val = base.held_out(n_test, 10_000 + base.seed)
        self.true_experts, self.seed, self.num_true = base.true_experts, base.seed, base.num_true


#: a cell: (arm, "recovery", experts, true) or (arm, "c1", tasks, k)
Cell = tuple[str, str, int, int]


def cells(config: SelectionConfig) -> list[Cell]:
    rec = [(a, "recovery", n, t) for n, t in config.shapes for a in config.arms]
    c1 = [(a, "c1", t, C1_K) for t in config.tasks for a in config.arms if a in C1_ARMS]
    return rec + c1


def cell_name(cell: Cell) -> str:
    arm, study, a, b = cell
    return f"{arm}/{a}x{b}" if study == "recovery" else f"{arm}/c1-T{a}"


def hparams_of(config: SelectionConfig, arm: Variant, shape: tuple[int, int]) -> dict[str, Any]:
    hp = tuned_hparams(arm, epochs=config.epochs)
    if arm.name in BUDGET_ARMS:
        hp["epochs"] = budget_epochs(int(hp["epochs"]), *shape)
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


def _c1_data_cfg(sizes: C1Sizes) -> dict[str, Any]:
    return {"study": "selection", "seed": C1_DATA_SEED, "n_train": sizes.n_train,
            "n_val": sizes.n_val, "n_test": sizes.n_test}  # fmt: skip


def _c1_record(arm: str, tasks: int, sizes: C1Sizes, hp: dict, rep: int) -> dict:
    return {
        "experiment": EXPERIMENT, "study": "c1", "phase": "test", "arm": arm,
        "variant": C1_ARMS[arm].identity(), "num_tasks": tasks, "num_experts": tasks // 4,
        "k": C1_K, "hparams": dict(sorted(hp.items())), "rep": rep, "init_seed": init_seed(rep),
        "shuffle_seed": STUDY_SEED, "data": _c1_data_cfg(sizes),
    }  # fmt: skip


def _counting(
    arm: Variant, train: Callable[[Variant], list[dict[str, float]]], examples: int
) -> list[dict[str, float]]:
    """The metrics ``train(arm)`` returns (``arm`` with its search plan counting, see
    :class:`CountedPlan`), each with the probe passes of the searches it ran (every candidate
    evaluation scores every member of the vectorised bank) and their share of the ``examples``
    the training passed."""
    s = arm.search
    plan = None if s is None else CountedPlan(s.at, s.binarize, s.refit, s.probe)
    metrics = train(arm if plan is None else replace(arm, search=plan))
    searches = [] if plan is None else plan.searches
    passes = sum(res.evaluations for s in searches for res in s.results)
    for m in metrics:
        m["probe_passes"] = float(passes)
        m["probe_share"] = passes * SearchPlan.probe / examples
    return metrics


def _run_c1_cell(config: SelectionConfig, name: str, tasks: int, data: SyntheticData,
                 progress: bool, store: RunStore) -> dict:  # fmt: skip
    """Tune the arm at T = ``tasks`` on validation, then retrain the selection ``reps`` times
    and evaluate it once on the test split."""
    arm, sizes = C1_ARMS[name], config.c1
    shape = {"num_experts": tasks // 4, "k": C1_K}
    per_config = EPOCHS_AXIS if arm.schedules or arm.search is not None else 1
    points = None if sizes.points is None else sizes.points * per_config
    no_test = replace(data, x_test=data.x_val, y_test=data.y_val)
    selected = c1_tune(
        arm, tasks, no_test, store, trials=sizes.trials, max_points=points, seed=STUDY_SEED,
        data_cfg=_c1_data_cfg(sizes), progress=progress, shape=shape,
    )  # fmt: skip
    hp = dict(selected["hparams"])
    cfgs = [_c1_record(name, tasks, sizes, hp, r) for r in range(sizes.reps)]
    todo = missing(store, cfgs)
    if todo:
        metrics = _counting(
            arm,
            lambda counted: c1_train_reps(
                counted, tasks, hp, [init_seed(r) for r in todo], data, shuffle_seed=STUDY_SEED,
                progress=progress, desc=f"{name}/c1-T{tasks} test", num_experts=tasks // 4,
                k=C1_K,
            )[int(hp["epochs"])],
            total_steps(int(hp["epochs"]), sizes.n_train, C1_BATCH) * C1_BATCH,
        )  # fmt: skip
        for m, i in zip(metrics, todo, strict=True):
            store.save(cfgs[i], m)
    rule = f"{RULE} (the validation MSE over the trials; binary configurations first, Appendix D)"
    return {**selected, "rule": rule}


def run_cell(
    config: SelectionConfig, cell: Cell, data: Any, progress: bool, store: RunStore
) -> dict:
    """Tune on validation, then retrain the selection and evaluate it once on the test set."""
    name, study, a, b = cell
    if study == "c1":
        return _run_c1_cell(config, name, a, data, progress, store)
    arm, shape = ARMS[name], (a, b)
    base = RecoveryData(data_seed(a, b), N_TRAIN, N_VAL, num_true=b)
    hp = hparams_of(config, arm, shape)
    examples = total_steps(int(hp["epochs"]), N_TRAIN, BATCH_SIZE) * BATCH_SIZE

    def train(cfgs: list[dict[str, Any]], data: Any, phase: str) -> None:
        """Train the runs of ``cfgs`` not recorded yet, as one vectorized model."""
        todo = missing(store, cfgs)
        if not todo:
            return
        lrs, reps = [cfgs[i]["lr"] for i in todo], [cfgs[i]["rep"] for i in todo]
        metrics = _counting(
            arm,
            lambda counted: train_reps(
                counted, {**hp, "lr": lrs[0]}, data, [init_seed(r) for r in reps],
                shuffle_seed=STUDY_SEED, experts=a, k=b, lrs=lrs, record_every=0,
                progress=progress, desc=f"{cell_name(cell)} {phase}",
            )[0],
            examples,
        )  # fmt: skip
        for m, i in zip(metrics, todo):
            if phase == "test":
                m = {k.replace("val_", "test_"): v for k, v in m.items()}
            store.save(cfgs[i], m)

    cfgs = [
        _record(name, shape, hp, lr, r, "tune") for lr in config.lrs for r in range(config.reps)
    ]
    train(cfgs, base, "tune")
    loss: dict[float, list[Any]] = {}
    for c in cfgs:
        rec = read_record(store.path(run_id(c)))
        # a diverged run (non-finite or exploded, recovery's bound) counts as non-finite
        bad = diverged(rec, RECOVERY_FINITE)
        loss.setdefault(c["lr"], []).append(math.inf if bad else rec["metrics"]["val_loss"])
    # the shared rule (dselectk_research.best) over the learning rates, smallest first (ties go
    # to the smaller); a learning rate with a diverged repetition is ineligible; every one
    # diverged: the smallest
    choice = best_configuration((v, loss[v]) for v in sorted(loss))
    lr = min(loss) if choice.key is None else choice.key
    tests = [_record(name, shape, hp, lr, r, "test") for r in range(config.reps)]
    train(tests, HeldOutData(base), "test")
    return {"lr": lr, "lrs": list(config.lrs), "rule": f"{RULE} (learning rates, smallest first)"}
