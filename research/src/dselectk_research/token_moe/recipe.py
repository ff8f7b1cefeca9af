"""``dselectk reproduce token-moe``: flags, the typed run config and one cell (a router: all
its seeds), run by the shared runner; one record per (router, seed)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dselectk.gates.registry import gate_spec
from dselectk.variants import Ramp, Variant
from dselectk_research import char_lm
from dselectk_research.args import (
    SEED_MAX,
    Switch,
    add_config_arguments,
    check_fits,
    config_from_args,
    fraction,
    hparam_type,
    int_at_least,
    nonnegative_float,
    positive_float,
    seed_value,
    setting,
)
from dselectk_research.data.text import Corpus, load_corpus
from dselectk_research.records import RunStore
from dselectk_research.runner import (
    Recipe,
    add_run_arguments,
    executor_from_args,
    missing,
    run_recipe,
)
from dselectk_research.token_moe.model import (
    DEFAULT_ROUTERS,
    EXPERIMENT,
    ROUTERS,
    WARMUP_STEPS,
    train_run,
)
from dselectk_research.token_moe.report import diverged_line, print_table, write_report


def _flag(default: Any, kind: Callable[[str], Any], note: str = "") -> Any:
    """A study :func:`setting` taking a value (renormalize's False too): its default, its argparse
    type (the value's domain) and the help ``note`` (the help formatter adds the default)."""
    note = note.strip()
    if note.startswith("(") and note.endswith(")"):
        note = note[1:-1]
    return setting(default, note, type=kind, action="store")


_DK = gate_spec("dselect_k").hparams


@dataclass(frozen=True)
class TokenMoEConfig:
    """What a ``reproduce token-moe`` command computes: the routers, seeds, and the study
    settings (one ``--flag`` each but ``val_fraction`` and ``heads``; their defaults,
    :data:`DEFAULTS`, are the default study). Settings that cannot run together are a
    ValueError naming the flags."""

    out: Path
    gates: tuple[str, ...] = setting(
        DEFAULT_ROUTERS,
        f"routers (default: {' '.join(DEFAULT_ROUTERS)}; also "
        f"{' '.join(n for n in ROUTERS if n not in DEFAULT_ROUTERS)})",
        choices=list(ROUTERS),
    )
    seeds: int = setting(3, "seeds per router (paired across routers)", type=int_at_least(1))
    first_seed: int = setting(0, "seeds run: first-seed, first-seed + 1, ...", type=seed_value)
    telemetry: bool = False
    corpus_bytes: int = _flag(1_500_000, int_at_least(1), "bytes of the corpus read")
    val_fraction: float = 0.1
    seq_len: int = _flag(64, int_at_least(1), "tokens (bytes) per window")
    d_model: int = _flag(64, int_at_least(1), "model width; a multiple of the attention heads (4)")
    layers: int = _flag(2, int_at_least(1), "transformer blocks")
    heads: int = 4
    d_ff: int = _flag(128, int_at_least(1), "hidden width of an expert")
    num_experts: int = _flag(8, int_at_least(2), "experts per MoE layer")
    k: int = _flag(2, int_at_least(1), "experts a token is sent to")
    batch_size: int = _flag(32, int_at_least(1), "windows per batch")
    steps: int = _flag(
        1000, int_at_least(WARMUP_STEPS + 1), f"training steps; > {WARMUP_STEPS} (warm-up)"
    )
    lr: float = _flag(2e-3, positive_float, "learning rate")
    balance_loss_weight: float = _flag(0.01, nonnegative_float, "weight of the load-balancing loss")
    gamma: float = _flag(1.0, hparam_type(_DK["gamma"]), "DSelect-k's γ")
    entropy_reg: float = _flag(
        0.0,
        hparam_type(_DK["entropy_reg"]),
        "DSelect-k's λ (0 measured best per token; the paper's 0.01 was worse)",
    )
    entropy_reg_end: float | None = _flag(
        None,
        hparam_type(_DK["entropy_reg"]),
        "λ of the last step: DSelect-k routers' λ ramps linearly to it (default: no ramp)",
    )
    entropy_warmup: float = _flag(
        0.0, fraction, "with --entropy-reg-end: the fraction of the steps at λ = 0 first"
    )
    router_k: int | None = _flag(
        None,
        int_at_least(1),
        "selectors of a DSelect-k router; the layer still sends a token to its --k largest "
        "weights (default: --k + 1, at most --num-experts)",
    )
    val_windows: int = _flag(
        2048, int_at_least(1), "validation windows, at most (fewer if the validation part is short)"
    )
    renormalize: bool = setting(
        True,
        "rescale a token's kept weights to sum to 1 when the top-k cut drops some (token "
        "routing only: --no-renormalize for expert choice)",
        action=Switch,
    )
    capacity_factor: float | None = _flag(
        None,
        positive_float,
        "c: each expert of a layer takes at most ceil(c·N·k/n) of a batch's N·k (token, "
        "expert) pairs, first choices first, the rest dropped; expert choice: its capacity "
        "factor, 1 when unset (default: no limit)",
    )

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(
                f"--d-model {self.d_model}: must be a multiple of the {self.heads} attention heads"
            )
        if self.k > self.num_experts:
            raise ValueError(f"--k {self.k}: at most --num-experts ({self.num_experts})")
        if self.router_k is None:  # the default, stored as the number it stands for
            object.__setattr__(self, "router_k", min(self.k + 1, self.num_experts))
        if not self.k <= self.router_k <= self.num_experts:
            raise ValueError(
                f"--router-k {self.router_k}: from --k ({self.k}) to --num-experts "
                f"({self.num_experts})"
            )
        expert_routed = [g for g in self.gates if ROUTERS[g].routing == "expert"]
        if self.renormalize and expert_routed:
            raise ValueError(
                f"--renormalize (the default): applies to token routing only, not to --gates "
                f"{' '.join(expert_routed)}; add --no-renormalize"
            )
        if self.entropy_warmup and self.entropy_reg_end is None:
            raise ValueError(
                f"--entropy-warmup {self.entropy_warmup}: needs --entropy-reg-end (the ramp it "
                "delays)"
            )
        need = self.seq_len + 2  # a train window of seq_len + 1 bytes, a validation window

        def fits(n: int) -> bool:
            return need - 1 <= int(n * self.val_fraction) <= n - need

        if not fits(self.corpus_bytes):
            least = next((n for n in range(2 * need - 1, 10**7) if fits(n)), "more")
            raise ValueError(
                f"--corpus-bytes {self.corpus_bytes}: too small for one window of --seq-len "
                f"{self.seq_len} in both parts; at least {least}"
            )
        check_fits(
            self.batch_size * self.seq_len * char_lm.train_bytes_per_token(self.hparams()),
            f"--batch-size {self.batch_size} × --seq-len {self.seq_len} (training activations)",
        )

    def hparams(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SETTINGS}

    def variant(self, router: str) -> Variant:
        """The router's variant, with the λ ramp of --entropy-reg-end for the routers whose
        gate takes λ (λ = 0 for the --entropy-warmup fraction of the steps, then a linear
        ramp from --entropy-reg to --entropy-reg-end)."""
        if self.entropy_reg_end is None:
            return ROUTERS[router]
        ramp = Ramp("entropy_reg", end=self.entropy_reg_end, delay=self.entropy_warmup, before=0.0)
        return ROUTERS[router].with_ramps([ramp])

    def record_hparams(self) -> dict[str, Any]:
        """The study settings as the records store them (their identity): every setting,
        sorted by name."""
        return dict(sorted(self.hparams().items()))


#: the fields of the run config that say which runs and where, not how each trains
NOT_SETTINGS = frozenset({"out", "gates", "seeds", "first_seed", "telemetry"})
#: the settings every record stores (its identity), by name
SETTINGS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(TokenMoEConfig) if f.name not in NOT_SETTINGS
)
#: the default study (``dselectk reproduce token-moe``): the measured recommendation per token
#: (λ = 0, renormalised, one selector more than the k experts dispatched), as its records store
#: it (``router_k`` resolved to a number)
DEFAULTS: dict[str, Any] = TokenMoEConfig(Path("results/token_moe")).hparams()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line flags of ``dselectk reproduce token-moe``."""
    add_run_arguments(p, out="results/token_moe", cells="routers")
    add_config_arguments(p, TokenMoEConfig)


def run_cell(
    config: TokenMoEConfig, router: str, corpus: Corpus, progress: bool, store: RunStore
) -> dict:
    """Train every seed of ``router`` not recorded yet (one record each)."""
    hp, ident = config.hparams(), config.record_hparams()
    data = {"files_sha256": corpus.sha256, "files": len(corpus.files)}
    data.update(train_bytes=len(corpus.train), val_bytes=len(corpus.val))
    variant = config.variant(router)
    cfgs = [
        {"experiment": EXPERIMENT, "router": router, "variant": variant.identity(),
         "seed": s, "hparams": ident, "corpus": data}
        for s in range(config.first_seed, config.first_seed + config.seeds)
    ]  # fmt: skip
    files = {"corpus_files": corpus.files, "corpus_content_sha256": corpus.content_sha256}
    for i in missing(store, cfgs):
        seed = config.first_seed + i
        tel = Path(config.out) / "telemetry" / f"{router}-seed{seed}" if config.telemetry else None
        metrics = train_run(
            variant, hp, corpus, seed, progress=progress, desc=f"{router} seed {seed}",
            telemetry_dir=tel,
        )  # fmt: skip
        extra = {"diverged": True} if "diverged_at_step" in metrics else {}
        store.save(cfgs[i], metrics, **extra, **files, corpus_root=corpus.root)
    return {"hparams": ident}


def _load_data(config: TokenMoEConfig) -> Corpus:
    corpus = load_corpus(config.corpus_bytes, config.val_fraction)
    size = len(corpus.train) + len(corpus.val)
    if size < config.corpus_bytes:  # the checks above assumed the whole budget
        raise ValueError(
            f"--corpus-bytes {config.corpus_bytes}: the source files under {corpus.root} hold "
            f"only {size} bytes; pass at most {size}"
        )
    return corpus


def _data_key(config: TokenMoEConfig) -> tuple[int, float]:
    return config.corpus_bytes, config.val_fraction


def recipe(config: TokenMoEConfig) -> Recipe:
    """One cell per router, for the shared runner."""
    return Recipe(
        cells=list(config.gates),
        run_cell=run_cell,
        load_data=_load_data,
        data_key=_data_key,
        cell_name=str,
        write_report=write_report,
        print_table=print_table,
        report_jobs=True,
        diverged=diverged_line,
        experiment=EXPERIMENT,
    )


def run(args: argparse.Namespace) -> int:
    """Run (or resume) every router × seed, then write the report."""
    cfg = config_from_args(TokenMoEConfig, args)
    if cfg.first_seed + cfg.seeds - 1 > SEED_MAX:
        raise ValueError(
            f"--first-seed {cfg.first_seed} --seeds {cfg.seeds}: the last seed would exceed "
            f"{SEED_MAX} (larger seeds alias smaller ones); lower them"
        )
    return run_recipe(recipe(cfg), cfg, executor_from_args(args, threads=args.threads))
