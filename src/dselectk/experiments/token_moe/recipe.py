"""``dselectk reproduce token-moe``: flags and one cell (a router: all its seeds), run by the
shared runner; one record per (router, seed)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dselectk.experiments.records import RunStore
from dselectk.experiments.runner import (
    Sweep,
    add_executor_arguments,
    cell_str,
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

__all__ = ["add_arguments", "hparams", "run", "run_cell", "sweep"]

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
    p.add_argument("--out", type=Path, default=Path("results/token_moe"), help="results folder")
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


def hparams(args: argparse.Namespace) -> dict[str, Any]:
    """The study's settings: the defaults overridden by the flags given."""
    hp = dict(DEFAULTS)
    for name in _FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            hp[name] = v
    return hp


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


def run_cell(args: argparse.Namespace, router: str, corpus: Corpus, progress: bool) -> dict:
    """Train every seed of ``router`` not recorded yet (one record each)."""
    store = RunStore(args.out)
    hp = hparams(args)
    cfgs = [_config(router, hp, s, corpus) for s in range(args.seeds)]
    for i in missing(store, cfgs):
        tel = Path(args.out) / "telemetry" / f"{router}-seed{i}" if args.telemetry else None
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


def _load_data(args: argparse.Namespace) -> Corpus:
    return load_corpus(hparams(args)["corpus_bytes"], DEFAULTS["val_fraction"])


def _data_key(args: argparse.Namespace) -> int:
    return int(hparams(args)["corpus_bytes"])


def sweep(args: argparse.Namespace) -> Sweep:
    """One cell per router, for the shared runner."""
    return Sweep(
        cells=list(args.gates),
        run_cell=run_cell,
        load_data=_load_data,
        data_key=_data_key,
        cell_name=cell_str,
    )


def run(args: argparse.Namespace) -> int:
    """Run (or resume) every router × seed, then write the report."""
    return run_recipe(
        sweep(args),
        args,
        threads=max(1, int(getattr(args, "threads", 1) or 1)),
        write_report=write_report,
        print_table=print_table,
        report_jobs=True,
    )
