"""``dselectk reproduce token-moe``: flags and one cell (a router: all its seeds), run by the
shared runner; one record per (router, seed)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dselectk.experiments.args import config_from_args, out_dir
from dselectk.experiments.records import RunStore
from dselectk.experiments.runner import (
    Recipe,
    add_executor_arguments,
    cell_str,
    executor_from_args,
    missing,
    run_recipe,
)
from dselectk.experiments.token_moe.model import (
    DEFAULTS,
    EXPERIMENT,
    GATES,
    Corpus,
    load_corpus,
    train_run,
)
from dselectk.experiments.token_moe.report import print_table, write_report

__all__ = ["TokenMoEConfig", "add_arguments", "config", "hparams", "recipe", "run", "run_cell"]

_FLAGS = (
    "steps",
    "batch_size",
    "d_model",
    "d_ff",
    "num_experts",
    "k",
    "layers",
    "lr",
    "corpus_bytes",
    "seq_len",
    "gamma",
    "entropy_reg",
    "balance_loss_weight",
    "val_windows",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line flags of ``dselectk reproduce token-moe``."""
    p.add_argument("--out", type=out_dir, default=Path("results/token_moe"), help="results folder")
    p.add_argument("--gates", nargs="+", default=list(GATES), choices=sorted(GATES))
    p.add_argument("--seeds", type=int, default=3, help="seeds per router (paired across routers)")
    for name in _FLAGS:
        kind = type(DEFAULTS[name])
        p.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=None, help=f"default {DEFAULTS[name]}"
        )
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="worker processes, each running whole routers (0: one per core)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument(
        "--telemetry",
        action="store_true",
        help="log routing telemetry of every run to OUT/telemetry/ (TensorBoard if installed, "
        "else JSON lines): binary tokens, experts per token, load, selector collisions",
    )
    add_executor_arguments(p)


@dataclass(frozen=True)
class TokenMoEConfig:
    """What a ``reproduce token-moe`` command computes (its run config).

    Attributes:
        settings: the study settings given on the command line (over :data:`DEFAULTS`).
    """

    out: Path
    gates: tuple[str, ...]
    seeds: int = 3
    telemetry: bool = False
    settings: tuple[tuple[str, Any], ...] = ()


def config(args: argparse.Namespace) -> TokenMoEConfig:
    """The run config of the parsed flags."""
    given = tuple((n, getattr(args, n)) for n in _FLAGS if getattr(args, n, None) is not None)
    return config_from_args(TokenMoEConfig, args, settings=given)


def hparams(config: TokenMoEConfig) -> dict[str, Any]:
    """The study's settings: the defaults overridden by the flags given."""
    return {**DEFAULTS, **dict(config.settings)}


def _config(router: str, hp: dict[str, Any], seed: int, corpus: Corpus) -> dict[str, Any]:
    return {
        "experiment": EXPERIMENT,
        "router": router,
        "seed": seed,
        "hparams": dict(sorted(hp.items())),
        "corpus": {
            "files_sha256": corpus.sha256,
            "files": len(corpus.files),
            "train_bytes": len(corpus.train),
            "val_bytes": len(corpus.val),
        },
    }


def run_cell(config: TokenMoEConfig, router: str, corpus: Corpus, progress: bool) -> dict:
    """Train every seed of ``router`` not recorded yet (one record each)."""
    store = RunStore(config.out)
    hp = hparams(config)
    cfgs = [_config(router, hp, s, corpus) for s in range(config.seeds)]
    for i in missing(store, cfgs):
        tel = Path(config.out) / "telemetry" / f"{router}-seed{i}" if config.telemetry else None
        metrics = train_run(
            router, hp, corpus, i, progress=progress, desc=f"{router} seed {i}", telemetry_dir=tel
        )
        store.save(
            cfgs[i],
            metrics,
            corpus_files=corpus.files,
            corpus_content_sha256=corpus.content_sha256,
            corpus_root=corpus.root,
        )
    return {"hparams": hp}


def _load_data(config: TokenMoEConfig) -> Corpus:
    return load_corpus(hparams(config)["corpus_bytes"], DEFAULTS["val_fraction"])


def _data_key(config: TokenMoEConfig) -> int:
    return int(hparams(config)["corpus_bytes"])


def recipe(config: TokenMoEConfig) -> Recipe:
    """One cell per router, for the shared runner."""
    return Recipe(
        cells=list(config.gates),
        run_cell=run_cell,
        load_data=_load_data,
        data_key=_data_key,
        cell_name=cell_str,
        write_report=write_report,
        print_table=print_table,
        report_jobs=True,
    )


def run(args: argparse.Namespace) -> int:
    """Run (or resume) every router × seed, then write the report."""
    cfg = config(args)
    threads = max(1, int(getattr(args, "threads", 1) or 1))
    return run_recipe(recipe(cfg), cfg, executor_from_args(args, threads=threads))
