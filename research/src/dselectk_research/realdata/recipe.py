"""The real-data sweep on the shared runner: the flags, one (setting, gate) cell (its
hyperparameters selected, then its missing final repetitions trained, one record each) and the
command (:func:`run_experiment`), which ends with ``run_info.json`` and the recipe's report.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from dselectk.io import write_json
from dselectk.progress import tqdm
from dselectk_research.args import add_config_arguments, config_from_args
from dselectk_research.executors import Executor
from dselectk_research.realdata import report as rd_report
from dselectk_research.realdata.plan import print_plan
from dselectk_research.realdata.plan import repetitions as _repetitions
from dselectk_research.realdata.spec import (
    VARIANTS,
    Experiment,
    RealDataConfig,
    Splits,
    cell_key,
    data_key,
    init_seed,
    label,
    record_config,
)
from dselectk_research.realdata.train import overrides, train_one, tune
from dselectk_research.records import RunStore, read_object
from dselectk_research.runner import Recipe, add_run_arguments, missing, run_recipe


def add_common_arguments(p: argparse.ArgumentParser, default_out: str, cls: type) -> None:
    """The runner's flags (:func:`add_run_arguments`: every worker of ``--jobs`` loads its own
    copy of the data, hence the default 1), then the settings of the run config ``cls``."""
    add_run_arguments(p, out=default_out, threads=1, jobs=1, cells="(setting, gate) cells")
    add_config_arguments(p, cls)


C = TypeVar("C", bound=RealDataConfig)


def config_of(
    cls: type[C], args: argparse.Namespace, quick_gates: Sequence[str] | None = None, **values: Any
) -> C:
    """The run config of the parsed flags: ``--gates`` (default all, or ``quick_gates`` in
    quick mode) and ``values`` (the recipe's own resolved defaults)."""
    gates = args.gates or (list(VARIANTS) if args.full or not quick_gates else quick_gates)
    return config_from_args(cls, args, gates=tuple(gates), **values)


class DataCache:
    """The data one command loaded for an experiment (the last key's splits): the cells of the
    main process reuse what :func:`prepare` loaded. A copy sent to a worker process (the recipe
    is pickled with it) arrives empty: every worker loads its own."""

    def __init__(self, exp: Experiment) -> None:
        self.exp = exp
        self.key: Hashable = None
        self.splits: Splits | None = None

    def load(self, config: RealDataConfig) -> Splits:
        """The experiment's data for ``config``, loaded once (again when its key changes)."""
        key = data_key(self.exp, config)
        if self.splits is None or self.key != key:
            self.clear()  # the old splits go before the new ones load
            self.splits, self.key = self.exp.load_data(config), key
        return self.splits

    def clear(self) -> None:
        self.splits, self.key = None, None

    def __getstate__(self) -> dict[str, Any]:
        return {"exp": self.exp, "key": None, "splits": None}


def run_cell(
    exp: Experiment,
    args: RealDataConfig,
    cell: tuple[Any, str],
    data: Splits,
    progress: bool,
    store: RunStore,
) -> dict[str, Any]:
    """One (setting, gate) cell: its hyperparameters (the grid search under ``--full``, else
    the quick defaults with the flags' overrides), then its missing final repetitions. Returns
    the cell's entry of ``selected_hparams.json``."""
    setting, gate = cell
    key = cell_key(exp.setting_key, gate, setting)
    if args.full:
        choice = tune(exp, args, gate, setting, data, store, progress)
        hp, selection = dict(choice["hparams"]), {**choice, "source": "random grid search (--full)"}
    else:
        hp = {**exp.quick_hparams[gate], **overrides(args)}
        selection = {"hparams": hp, "source": "quick default (untuned)"}
    VARIANTS[gate].check_hparams(hp, f"{exp.name} {key}")
    seeds = [init_seed(args.seed, gate, setting, rep) for rep in range(_repetitions(exp, args))]
    cfgs = [
        record_config(exp, gate, setting, hp, rep, s, args.seed, data.config, "final")
        for rep, s in enumerate(seeds)
    ]
    for rep in missing(store, cfgs):
        desc = f"{label(gate)} {key.split('/')[-1] if '/' in key else ''} rep {rep}".strip()
        tele = Path(args.out) / "telemetry" / f"{key.replace('/', '-')}-rep{rep}"
        metrics, extra = train_one(
            exp, gate, hp, setting, seeds[rep], data, progress=progress,
            record_trajectory=rep == 0, desc=desc, telemetry_dir=tele if args.telemetry else None,
        )  # fmt: skip
        store.save(cfgs[rep], metrics, **extra)
        if progress:
            tqdm.write(_done_message(desc, metrics))
    return selection


def _done_message(desc: str, m: dict[str, Any]) -> str:
    if "diverged_at_step" in m:
        return f"[{desc}] diverged at step {m['diverged_at_step']} (recorded as diverged)"
    msg = f"[{desc}] test loss {m['test_loss']:.4f}"
    if "test_mean_accuracy" in m:
        msg += f", mean acc {m['test_mean_accuracy']:.4f}"
    if "selected_experts" in m:
        msg += f", experts {m['selected_experts']:.2f}"
    return msg + f", {m['examples_per_second']:.0f} ex/s, {m['train_seconds']:.0f}s"


def _cell_name(exp: Experiment, cell: tuple[Any, str]) -> str:
    return cell_key(exp.setting_key, cell[1], cell[0])


def declares_gamma(gate: str) -> bool:
    """The gate declares the hyperparameter ``gamma`` (what ``--gamma`` overrides)."""
    variant = VARIANTS[gate].variant if gate in VARIANTS else None
    return variant is not None and "gamma" in variant.spec.hparams


def with_gamma(exp: Experiment, gamma: float | None) -> Experiment:
    """``exp`` with ``--gamma`` as the quick default and the only ``--full`` grid value of
    ``gamma`` of the gates that declare it; γ is then in every such run's ``hparams``."""
    if gamma is None:
        return exp
    g = float(gamma)
    quick = {
        gate: {**hp, "gamma": g} if declares_gamma(gate) else hp
        for gate, hp in exp.quick_hparams.items()
    }
    grid = {
        gate: {**axes, "gamma": [g]} if declares_gamma(gate) else axes
        for gate, axes in exp.grid.items()
    }
    return dataclasses.replace(exp, quick_hparams=quick, grid=grid)


def with_training_defaults(exp: Experiment, config: Any) -> Experiment:
    """``exp`` with the config's ``init`` and ``optimizer_defaults``."""
    return dataclasses.replace(exp, init=config.init, optimizer_defaults=config.optimizer_defaults)


def _printed(summary: Any) -> None:
    """The report was printed whole by its writer."""


def prepare(
    exp: Experiment, cache: DataCache, config: RealDataConfig, out: Path, executor: Executor
) -> bool:
    """Before the sweep: load the data (a missing data set fails before any worker starts),
    print the plan (``--full``, ``--dry-run``: False stops a dry run there), save the data's
    facts and the setup notes in ``run_info.json``, cache the recipe's reference predictors."""
    if executor.threads:
        torch.set_num_threads(executor.threads)
    data = cache.load(config)
    if config.full or config.dry_run:
        print_plan(exp, config, data, executor.jobs, executor.threads)
        if config.dry_run:
            return False
    notes = rd_report.template_notes(
        exp.template,
        quick=not config.full,
        init_note=f"this run used `--init {config.init} --optimizer-defaults "
        f"{config.optimizer_defaults}`.",
        epochs=config.epochs or exp.quick_hparams[config.gates[0]]["epochs"],
        repetitions=_repetitions(exp, config),
        **exp.notes(config, data),
    )
    info = read_object(out / "run_info.json")
    info.update(
        notes=notes,
        data=dict(data.config),
        meta={k: v for k, v in data.meta.items() if isinstance(v, (int, float, str))},
    )
    write_json(out / "run_info.json", info)
    if exp.reference is not None:
        rd_report.cached_reference(out, data.config, functools.partial(exp.reference, config, data))
    if executor.jobs > 1:
        cache.clear()  # the workers load their own copies
    return True


def write_report(
    exp: Experiment, config: RealDataConfig, out: Path, *, wall_seconds: float, command: str
) -> None:
    """``run_info.json`` (the command, its cumulative wall time, the data facts), then the
    recipe's report, printed whole."""
    facts = read_object(out / "run_info.json")
    run_info: dict[str, Any] = {
        "command": command,
        "wall_seconds": float(facts.get("wall_seconds") or 0.0) + wall_seconds,
        "mode": "full" if config.full else "quick",
        "training": {"init": exp.init, "optimizer_defaults": exp.optimizer_defaults},
        "repetitions": _repetitions(exp, config),
        **{key: facts[key] for key in ("notes", "data", "meta") if key in facts},
    }
    write_json(out / "run_info.json", run_info)
    rd_report.write_report(out, exp)
    print((out / "report.md").read_text(encoding="utf-8"))


def _diverged(summary: Mapping[str, Any]) -> str | None:
    """The one line naming the (setting, gate) cells whose runs diverged, or None."""
    bad = rd_report.diverged_cells(summary)
    if not bad:
        return None
    return (
        "runs diverged (non-finite or exploded test or validation loss) in "
        f"{', '.join(bad)}; the report counts them beside their gate and leaves them out of "
        "the means; lower --lr or check the settings"
    )


def _planned_runs(exp: Experiment, config: RealDataConfig, cell: tuple[Any, str]) -> int:
    return _repetitions(exp, config)


def build_recipe(exp: Experiment, config: RealDataConfig) -> Recipe:
    """The (setting, gate) cells of the config (settings outer, gates inner) for the shared
    runner, with the experiment's data, preparation and report (``--gamma`` applied)."""
    exp = with_gamma(with_training_defaults(exp, config), config.gamma)
    cache = DataCache(exp)
    return Recipe(
        cells=list(itertools.product(config.settings, config.gates)),
        run_cell=functools.partial(run_cell, exp),
        load_data=cache.load,
        data_key=functools.partial(data_key, exp),
        cell_name=functools.partial(_cell_name, exp),
        write_report=functools.partial(write_report, exp, config),
        print_table=_printed,  # the whole report was printed
        prepare=functools.partial(prepare, exp, cache, config),
        diverged=_diverged,
        planned_runs=functools.partial(_planned_runs, exp),
        experiment=exp.name,
    )


def run_experiment(exp: Experiment, config: RealDataConfig, executor: Executor) -> int:
    """Run (or resume) the sweep settings × gates × repetitions, then write the report."""
    return run_recipe(build_recipe(exp, config), config, executor)
