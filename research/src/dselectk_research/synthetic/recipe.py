"""``dselectk reproduce synthetic``: the flags, the run config and one (gate, T) cell, run by the
shared runner. On 2 cores, 2 one-thread processes ran the quick default 2.3x and the C.1 final
phase 1.3x faster than one two-thread process (hence ``--threads 0 --jobs 0``); batches of 100
repetitions were 1.6x faster on 2 threads than on 1.
"""

from __future__ import annotations

import argparse
import itertools
import operator
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dselectk.variants import Ramp, Variant
from dselectk_research.args import (
    add_config_arguments,
    check_fits,
    config_from_args,
    existing_file,
    fraction,
    int_at_least,
    positive_float,
    seed_value,
    setting,
)
from dselectk_research.catalog import hparam_setting
from dselectk_research.data.synthetic import SyntheticData, generate_data
from dselectk_research.records import RunStore, diverged
from dselectk_research.runner import (
    Recipe,
    add_run_arguments,
    executor_from_args,
    missing,
    run_recipe,
)
from dselectk_research.synthetic.report import FINITE, diverged_line, print_table, write_report
from dselectk_research.synthetic.spec import (
    DEFAULT_GATES,
    EXPERIMENT,
    VARIANTS,
    K,
    init_seed,
    load_tuned,
    record_config,
    resolve_hparams,
    tuned_entry,
    with_ramps,
)
from dselectk_research.synthetic.train import train_reps, tune

POS, NONNEG = int_at_least(1), int_at_least(0)
#: bytes per generated row while the data is built: 10 features and 128 task targets in float64
#: and float32, the experts' outputs of one group (estimate, rounded up)
DATA_BYTES_PER_ROW = 4096
#: memory one expert of one repetition takes while training (an upper estimate: its parameters
#: with gradients and Adam state, and its share of a batch's activations, about 3,500 floats)
BYTES_PER_EXPERT = 14_000


def task_count(text: str) -> int:
    """An argparse type: a task count T of the study, a multiple of 16 up to 128."""
    t = POS(text)
    if t % 16 or t > 128:
        raise argparse.ArgumentTypeError(f"expected one of 16, 32, ..., 128 (T/16 groups), got {t}")
    return t


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line flags of ``dselectk reproduce synthetic``."""
    add_run_arguments(p, out="results/synthetic", threads=0, jobs=0, cells="(gate, T) cells")
    add_config_arguments(p, SyntheticConfig)


@dataclass(frozen=True)
class SyntheticConfig:
    """What a ``reproduce synthetic`` command computes: the flags of the same names."""

    out: Path
    tasks: tuple[int, ...] = setting((16, 32, 64, 128), "T values", type=task_count)
    gates: tuple[str, ...] = setting(tuple(DEFAULT_GATES), choices=sorted(VARIANTS))
    experts: int | None = setting(None, "experts E of the model (default: T/4)", type=POS)
    k: int = setting(K, "experts each task selects", type=POS)
    reps: int | None = setting(None, "repetitions (default: 5; with --full 100)", type=POS)
    batch_reps: int | None = setting(None, "repetitions trained together", type=POS)
    seed: int = setting(0, "base seed (init, shuffling)", type=seed_value)
    data_seed: int = setting(0, "seed of the generated data", type=seed_value)
    full: bool = setting(False, "paper protocol: grid search + 100 reps")
    epochs: int | None = setting(None, "override the epochs of every gate", type=POS)
    lr: float | None = setting(None, "override the learning rate", type=positive_float)
    gamma: float | None = hparam_setting("gamma", None, "override DSelect-k's γ")
    gamma_end: float | None = hparam_setting("gamma", None, "anneal γ to this (log scale)")
    entropy_reg: float | None = hparam_setting("entropy_reg", None, "override λ (DSelect-k, abl.)")
    entropy_reg_end: float | None = hparam_setting("entropy_reg", None, "ramp λ linearly to this")
    entropy_warmup: float = setting(
        0.0,
        "with --entropy-reg-end: the fraction of the run with λ = 0 before the ramp",
        type=fraction,
    )
    temperature: float | None = hparam_setting(
        "temperature",
        None,
        "annealing start temperature s (Ablation (Annealing))",
        "--temperature-start",
    )
    n_train: int = setting(100_000, "training rows (the paper's 100k)", type=POS)
    n_eval: int = setting(20_000, "validation = test rows (the paper's 20k)", type=POS)
    tuned: Path | None = setting(  # noqa: RUF009 (a dataclasses.field)
        None,
        'tuning record to use (every --gates x --tasks cell needs an entry: its T or "default")',
        type=existing_file,
    )
    trials: int = setting(5, "--full: trials per grid point", requires="full", type=POS)
    max_points: int | None = setting(None, "--full: grid points sampled", requires="full", type=POS)
    telemetry: bool = False

    def overrides(self) -> dict[str, Any]:
        keys = ("epochs", "lr", "gamma", "entropy_reg", "temperature")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    def variant(self, gate: str) -> Variant:
        """The variant ``gate`` with the ramps of --gamma-end and --entropy-reg-end (of the
        hyperparameters it takes)."""
        ramps = []
        if self.gamma_end is not None:
            ramps.append(Ramp("gamma", end=self.gamma_end, shape="geometric"))
        if self.entropy_reg_end is not None:
            warm = self.entropy_warmup
            ramps.append(Ramp("entropy_reg", end=self.entropy_reg_end, delay=warm, before=0.0))
        return with_ramps(VARIANTS[gate], ramps)

    @property
    def repetitions(self) -> int:
        return self.reps if self.reps is not None else (100 if self.full else 5)

    def shape(self, num_tasks: int) -> dict[str, int]:
        return {"num_experts": self.experts or num_tasks // 4, "k": self.k}


def _with_overrides(
    source: str, args: SyntheticConfig, hp: dict[str, Any], base: dict[str, Any]
) -> str:
    """``source`` naming the command-line values that changed the record's (``base``: the
    record's values for the variant), so that a report does not credit the record with them."""
    used = {k: x for k, x in args.overrides().items() if k in hp and base.get(k) != x}
    if not used:
        return source
    flags = ", ".join(f"--{k.replace('_', '-')} {x:g}" for k, x in sorted(used.items()))
    return f"{source}, with {flags} from the command line"


def run_cell(
    args: SyntheticConfig,
    cell: tuple[str, int],
    data: SyntheticData,
    progress: bool,
    store: RunStore,
) -> dict[str, Any]:
    """Select the cell's hyperparameters (the grid search under ``--full``, else the tuning
    record) and train its missing final repetitions, one record each; returns the selection."""
    gate, t = cell
    v, shape = args.variant(gate), args.shape(t)
    data_cfg = {"seed": args.data_seed, "n_train": args.n_train, "n_eval": args.n_eval}
    if args.full:
        choice = tune(
            v,
            t,
            data,
            store,
            trials=args.trials,
            max_points=args.max_points,
            seed=args.seed,
            data_cfg=data_cfg,
            progress=progress,
            shape=shape,
        )
        hp = resolve_hparams(v, t, {}, {**choice["hparams"], **args.overrides()})
        selection = {**choice, "hparams": hp}
    else:
        tuned = load_tuned(args.tuned)
        hp = resolve_hparams(v, t, tuned, args.overrides())
        selection = {
            "hparams": hp,
            "source": _with_overrides(
                tuned.get("source", "tuned"), args, hp, resolve_hparams(v, t, tuned, {})
            ),
        }
    jobs = [(r, init_seed(args.seed, gate, t, r)) for r in range(args.repetitions)]

    def config(r: int, s: int) -> dict[str, Any]:
        return record_config(v, t, hp, r, s, args.seed, data_cfg, "final", shape)

    todo = [jobs[i] for i in missing(store, [config(r, s) for r, s in jobs])]
    batch_reps = args.batch_reps or min(args.repetitions, 100)
    for chunk in (todo[i : i + batch_reps] for i in range(0, len(todo), batch_reps)):
        reps = f"{chunk[0][0]}-{chunk[-1][0]}"
        telemetry = Path(args.out) / "telemetry" / f"{gate}-T{t}-reps{reps}"
        tc = time.perf_counter()
        res = train_reps(
            v,
            t,
            hp,
            [s for _, s in chunk],
            data,
            shuffle_seed=args.seed,
            progress=progress,
            desc=f"{gate} T={t} reps {reps}",
            return_model=True,
            telemetry_dir=telemetry if args.telemetry else None,
            num_experts=shape["num_experts"],
            k=shape["k"],
        )
        assert isinstance(res, tuple)
        elapsed = time.perf_counter() - tc
        final, w = res[0][int(hp["epochs"])], res[1].inference_weights()
        for i, (r, s) in enumerate(chunk):
            extra: dict[str, Any] = {"train_seconds": elapsed / len(chunk)}
            if diverged({"metrics": final[i]}, FINITE):  # non-finite or exploded
                extra["diverged"] = True  # counted in the report, never averaged
            if r == 0:
                extra["weights"] = [[round(float(x), 4) for x in row] for row in w[i]]
            store.save(config(r, s), final[i], **extra)
    return selection


def _generate(args: SyntheticConfig) -> SyntheticData:
    return generate_data(args.data_seed, args.n_train, args.n_eval, args.n_eval)


def _cell_name(cell: tuple[str, int]) -> str:
    return f"{cell[0]}/{cell[1]}"


def _planned_runs(args: SyntheticConfig, cell: tuple[str, int]) -> int:
    return args.repetitions


def recipe(config: SyntheticConfig) -> Recipe:
    """The (gate, T) cells of the command line, for the shared runner."""
    return Recipe(
        cells=list(itertools.product(config.gates, sorted(config.tasks))),
        run_cell=run_cell,
        load_data=_generate,
        data_key=operator.attrgetter("data_seed", "n_train", "n_eval"),
        cell_name=_cell_name,
        cost=operator.itemgetter(1),  # the largest T first: long cells should not end up last
        write_report=write_report,
        print_table=print_table,
        diverged=diverged_line,
        planned_runs=_planned_runs,
        experiment=EXPERIMENT,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(SyntheticConfig, args)
    for t in config.tasks:
        e = config.shape(t)["num_experts"]
        if config.k > e:
            what = f"--experts {config.experts}" if config.experts else f"T/4 = {e} at --tasks {t}"
            raise ValueError(f"--k {config.k}: more than the model's experts ({what})")
    # the generated data (float64 while built, all 128 tasks) before any allocation
    rows = config.n_train + 2 * config.n_eval
    what = f"arguments --n-train/--n-eval ({config.n_train:,} + 2 x {config.n_eval:,} rows)"
    check_fits(rows * DATA_BYTES_PER_ROW, what)
    # the repetitions of a cell train as one model: parameters, Adam state, activations
    experts = max(config.shape(t)["num_experts"] for t in config.tasks)
    what = f"--reps {config.repetitions} × {experts} experts (repetitions trained as one model)"
    check_fits(config.repetitions * experts * BYTES_PER_EXPERT, what)
    if config.tuned is not None and config.full:
        raise ValueError(
            f"--tuned {config.tuned}: --full selects the hyperparameters by its own grid "
            "search; drop one of the two"
        )
    if config.tuned is not None:
        # refused up front: a cell without an entry would silently train with the built-in
        # settings while the report credits the file
        tuned = load_tuned(config.tuned)
        absent = [
            f"{g}/{t}"
            for g in config.gates
            for t in config.tasks
            if tuned_entry(tuned, VARIANTS[g], t) is None
        ]
        if absent:
            raise ValueError(
                f"--tuned {config.tuned}: no hyperparameters for {', '.join(absent)} (give each "
                'gate an entry for these T or a "default" one, or drop --tuned)'
            )
    return run_recipe(recipe(config), config, executor_from_args(args, threads=args.threads))
