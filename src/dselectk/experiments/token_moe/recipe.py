"""``dselectk reproduce token-moe``: flags, the typed run config and one cell (a router: all
its seeds), run by the shared runner; one record per (router, seed)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dselectk.experiments.args import (
    config_from_args,
    hparam_type,
    int_at_least,
    nonnegative_float,
    positive_float,
)
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
    EXPERIMENT,
    ROUTERS,
    WARMUP_STEPS,
    Corpus,
    load_corpus,
    train_run,
)
from dselectk.experiments.token_moe.report import print_table, write_report
from dselectk.gates.registry import gate_spec

__all__ = ["DEFAULTS", "TokenMoEConfig", "add_arguments", "config", "hparams", "run", "run_cell"]


@dataclass(frozen=True)
class TokenMoEConfig:
    """What a ``reproduce token-moe`` command computes (its run config): the routers, seeds,
    and the study settings (their defaults: :data:`DEFAULTS`, the default study).

    Raises:
        ValueError: settings that cannot run together, naming the flags.
    """

    out: Path
    gates: tuple[str, ...] = tuple(ROUTERS)
    seeds: int = 3
    telemetry: bool = False
    corpus_bytes: int = 1_500_000
    val_fraction: float = 0.1
    seq_len: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    d_ff: int = 128
    num_experts: int = 8
    k: int = 2
    batch_size: int = 32
    steps: int = 1000
    lr: float = 2e-3
    balance_loss_weight: float = 0.01
    gamma: float = 1.0
    entropy_reg: float = 0.01
    val_windows: int = 2048

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(
                f"--d-model {self.d_model}: must be a multiple of the {self.heads} attention heads"
            )
        if self.k > self.num_experts:
            raise ValueError(f"--k {self.k}: at most --num-experts ({self.num_experts})")
        need = self.seq_len + 2  # a train window of seq_len + 1 bytes, a validation window

        def fits(n: int) -> bool:
            return need - 1 <= int(n * self.val_fraction) <= n - need

        if not fits(self.corpus_bytes):
            least = next((n for n in range(2 * need - 1, 10**7) if fits(n)), "more")
            raise ValueError(
                f"--corpus-bytes {self.corpus_bytes}: too small for one window of --seq-len "
                f"{self.seq_len} in both parts; at least {least}"
            )


#: the default study (``dselectk reproduce token-moe``): the settings every record stores
DEFAULTS: dict[str, Any] = {
    f.name: f.default
    for f in dataclasses.fields(TokenMoEConfig)
    if f.name not in ("out", "gates", "seeds", "telemetry")
}


_DK = gate_spec("dselect_k").hparams
#: the study's numeric flags: the argparse type (each value's domain) and a note for --help
_FLAGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "steps": (int_at_least(WARMUP_STEPS + 1), f"; > the {WARMUP_STEPS} warm-up steps"),
    "batch_size": (int_at_least(1), ""),
    "d_model": (int_at_least(1), "; a multiple of the attention heads (4)"),
    "d_ff": (int_at_least(1), ""),
    "num_experts": (int_at_least(2), ""),
    "k": (int_at_least(1), ""),
    "layers": (int_at_least(1), ""),
    "lr": (positive_float, ""),
    "corpus_bytes": (int_at_least(1), ""),
    "seq_len": (int_at_least(1), ""),
    "gamma": (hparam_type(_DK["gamma"]), " (DSelect-k's γ)"),
    "entropy_reg": (hparam_type(_DK["entropy_reg"]), " (DSelect-k's λ)"),
    "balance_loss_weight": (nonnegative_float, ""),
    "val_windows": (int_at_least(1), ""),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line flags of ``dselectk reproduce token-moe``."""
    p.add_argument("--out", type=Path, default=Path("results/token_moe"), help="results folder")
    p.add_argument("--gates", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    p.add_argument(
        "--seeds", type=int_at_least(1), default=3, help="seeds per router (paired across routers)"
    )
    for name, (kind, note) in _FLAGS.items():
        flag, default = f"--{name.replace('_', '-')}", DEFAULTS[name]
        p.add_argument(flag, type=kind, default=default, help=f"default {default}{note}")
    p.add_argument("--threads", type=int_at_least(1), default=1, help="torch threads per process")
    p.add_argument(
        "--jobs",
        type=int_at_least(0),
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


def config(args: argparse.Namespace) -> TokenMoEConfig:
    """The run config of the parsed flags."""
    return config_from_args(TokenMoEConfig, args)


def hparams(config: TokenMoEConfig) -> dict[str, Any]:
    """The study's settings (the keys of :data:`DEFAULTS`), as the records store them."""
    return {name: getattr(config, name) for name in DEFAULTS}


def _run_config(router: str, hp: dict[str, Any], seed: int, corpus: Corpus) -> dict[str, Any]:
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
    cfgs = [_run_config(router, hp, s, corpus) for s in range(config.seeds)]
    for i in missing(store, cfgs):
        tel = Path(config.out) / "telemetry" / f"{router}-seed{i}" if config.telemetry else None
        metrics = train_run(
            ROUTERS[router], hp, corpus, i, progress=progress, desc=f"{router} seed {i}",
            telemetry_dir=tel,
        )  # fmt: skip
        store.save(
            cfgs[i],
            metrics,
            corpus_files=corpus.files,
            corpus_content_sha256=corpus.content_sha256,
            corpus_root=corpus.root,
        )
    return {"hparams": hp}


def _load_data(config: TokenMoEConfig) -> Corpus:
    return load_corpus(config.corpus_bytes, config.val_fraction)


def _data_key(config: TokenMoEConfig) -> tuple[int, float]:
    return config.corpus_bytes, config.val_fraction


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
    return run_recipe(
        recipe(cfg), cfg, executor_from_args(args, threads=getattr(args, "threads", 1))
    )
