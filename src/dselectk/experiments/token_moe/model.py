"""The token-MoE study's corpus (the Python standard library's source), its routers (one
:class:`~dselectk.variants.Variant` each), and one training run of
:class:`~dselectk.models.char_lm.CharMoETransformer`."""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from dselectk.experiments.runner import progress_position
from dselectk.models.char_lm import CharMoETransformer, byte_windows, evaluate, random_windows
from dselectk.telemetry import RoutingTelemetry
from dselectk.training import (
    Callback,
    History,
    TaskData,
    TrainConfig,
    TrainingDivergedError,
    make_optimizer,
    train,
)
from dselectk.variants import Variant, variant_table

__all__ = ["ROUTERS", "Corpus", "build_model", "load_corpus", "train_run"]

EXPERIMENT = "token-moe"


@dataclass(frozen=True)
class Router(Variant):
    """A router of the study: a gate variant, and who chooses (``routing``: "token", each token
    its k experts; "expert", expert choice: each expert its k·N/n tokens of the batch)."""

    routing: str = "token"

    def identity(self) -> dict[str, Any]:
        ident = super().identity()
        return ident if self.routing == "token" else {**ident, "routing": self.routing}


def routing_of(variant: Variant) -> str:
    """Who chooses in ``variant``'s MoE layers: "token" unless it is an expert-choice
    :class:`Router`."""
    return variant.routing if isinstance(variant, Router) else "token"


#: the routers compared (``--gates``); DSelect-k takes the study's ``gamma`` and ``entropy_reg``
ROUTERS = variant_table(
    Variant("dselect_k", "dselect_k", "DSelect-k (per token)"),
    Variant("topk", "topk", "Top-k"),
    Variant(
        "dselect_k_distinct",
        "dselect_k",
        "DSelect-k, distinct codes (ours)",
        options={"distinct": True},
    ),
    Variant(
        "dselect_k_diversity",
        "dselect_k",
        "DSelect-k, diversity μ = 0.1 (ours)",
        options={"diversity": 0.1},
    ),
    Router(
        "expert_choice",
        "softmax",
        "Expert choice (Zhou et al. 2022; softmax router, capacity k·N/n)",
        routing="expert",
    ),
)
#: the routers a command runs without ``--gates`` (expert choice sees the whole batch, future
#: tokens included: a competitor to run on purpose, not a default)
DEFAULT_ROUTERS = ("dselect_k", "topk", "dselect_k_distinct", "dselect_k_diversity")
#: optimizer steps the step timer leaves out (warm-up)
WARMUP_STEPS = 10


@dataclass
class Corpus:
    """Byte streams of the train and validation parts, and what was read."""

    train: Tensor
    val: Tensor
    files: list[str]
    """Paths relative to the stdlib folder, in reading order."""
    sha256: str
    """Hash of the file list (one relative path a line), identifying the corpus."""
    content_sha256: str
    """Hash of the bytes read."""
    root: str


def load_corpus(
    max_bytes: int = 1_500_000, val_fraction: float = 0.1, root: str | Path | None = None
) -> Corpus:
    """The first ``max_bytes`` of the stdlib's ``*.py`` files (sorted by relative path, tests
    and site-packages left out, whole files), as bytes; the last ``val_fraction`` of the stream
    is the validation part (a fixed, contiguous split)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    found = [p for p in base.rglob("*.py") if not skip & set(p.relative_to(base).parts[:-1])]
    chunks: list[bytes] = []
    names: list[str] = []
    total = 0
    for p in sorted(found, key=lambda p: p.relative_to(base).as_posix()):
        if total >= max_bytes:
            break
        chunks.append(p.read_bytes())
        names.append(p.relative_to(base).as_posix())
        total += len(chunks[-1])
    if total == 0:
        raise ValueError(f"no *.py files under {base}")
    blob = b"".join(chunks)[:max_bytes]
    stream = torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()
    n_val = int(len(stream) * val_fraction)
    return Corpus(
        train=stream[: len(stream) - n_val],
        val=stream[len(stream) - n_val :],
        files=names,
        sha256=hashlib.sha256("\n".join(names).encode()).hexdigest(),
        content_sha256=hashlib.sha256(blob).hexdigest(),
        root=str(base),
    )


def build_model(variant: Variant, hp: Mapping[str, Any]) -> CharMoETransformer:
    """The study's transformer, every MoE layer routed by a gate of ``variant`` (with the
    gate's hyperparameters found in ``hp``)."""
    shape = (
        "seq_len",
        "d_model",
        "heads",
        "layers",
        "d_ff",
        "k",
        "balance_loss_weight",
        "renormalize",
    )
    hidden = int(hp.get("router_hidden", 0))
    router = partial(
        variant.build, hp["num_experts"], hparams=hp, k=hp["k"], in_features=hidden or hp["d_model"]
    )
    return CharMoETransformer(
        router,
        routing=routing_of(variant),
        router_hidden=hidden,
        **{name: hp[name] for name in shape},
    )


def make_optimizer_for(model: CharMoETransformer, hp: Mapping[str, Any]) -> Optimizer | None:
    """Adam with the routers' parameters (:meth:`~dselectk.layers.SparseMoEFeedForward.
    router_parameters`) at ``lr × router_lr_scale`` and the rest at ``lr``; None (the training
    loop's own Adam over every parameter at ``lr``) when the scale is 1."""
    scale = float(hp.get("router_lr_scale", 1.0))
    if scale == 1.0:
        return None
    lr = float(hp["lr"])
    routing = {id(p) for m in model.moe_layers for p in m.router_parameters()}
    rest = [p for p in model.parameters() if id(p) not in routing]
    routers = [p for p in model.parameters() if id(p) in routing]
    groups = [{"params": rest}, {"params": routers, "lr": lr * scale}]
    return make_optimizer("adam", groups, lr)


def _lm_loss(model: Any, batch: TaskData) -> tuple[Tensor, None]:
    return model.loss(batch.x, batch.ys[0]), None


class _StepTimer(Callback):
    """Wall time of the optimizer steps after the first :data:`WARMUP_STEPS`."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.steps = 0

    def on_step(self, model: nn.Module, batch: TaskData, out: Any, history: History) -> None:
        if history.steps == WARMUP_STEPS:
            self.t0, self.steps = time.perf_counter(), 0
        elif self.t0 is not None:
            self.steps += 1

    def per_step(self) -> float:
        return (time.perf_counter() - self.t0) / self.steps if self.t0 and self.steps else math.nan


def train_run(
    variant: Variant,
    hp: Mapping[str, Any],
    corpus: Corpus,
    seed: int,
    *,
    progress: bool,
    desc: str,
    telemetry_dir: Path | None = None,
    callbacks: list[Callback] | None = None,
) -> dict[str, Any]:
    """Train one model for ``hp["steps"]`` steps on random windows; returns its metrics (a run
    whose loss or gradients become non-finite stops there: ``val_bpc`` NaN and the step).

    With ``telemetry_dir``, routing telemetry (:class:`~dselectk.telemetry.RoutingTelemetry`:
    binary fraction, experts per token, load, selector collisions, per router) is logged there
    20 times over the run (TensorBoard if installed, else JSON lines). ``callbacks`` are
    passed on to :func:`~dselectk.training.train` (e.g. a diagnosis that watches the routers).
    """
    torch.manual_seed(seed)
    model = build_model(variant, hp)
    seq, steps = int(hp["seq_len"]), int(hp["steps"])
    # random windows (one draw per run seed): every run sees other cuts of the text
    g = torch.Generator().manual_seed(seed)
    x, y = random_windows(corpus.train, seq, steps * int(hp["batch_size"]), g)
    data = TaskData(x, [y])
    timer = _StepTimer()
    callbacks = [timer, *(callbacks or [])]
    # the variant's ramps (γ, λ, ...), one scheduler per MoE layer's router
    scheds = [s for m in model.moe_layers for s in variant.schedulers(m.router, hp, steps)]
    if telemetry_dir is not None:
        callbacks.append(RoutingTelemetry(telemetry_dir, every=max(1, steps // 20), probe_size=16))
    cfg = TrainConfig(
        lr=float(hp["lr"]),
        batch_size=int(hp["batch_size"]),
        epochs=1,
        seed=None,
        shuffle_seed=seed,
        progress=progress,
        progress_unit="step",
        desc=desc,
        position=progress_position(),
    )
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    t0 = time.perf_counter()
    try:
        hist = train(
            model,
            data,
            None,
            cfg,
            schedulers=scheds,
            optimizer=make_optimizer_for(model, hp),
            callbacks=callbacks,
            loss_fn=_lm_loss,
        )
    except TrainingDivergedError as e:  # recorded as diverged: counted, never averaged
        return {
            "val_bpc": math.nan,
            "train_loss": math.nan,
            "diverged_at_step": e.step,
            "diverged_because": str(e),
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "load_average_at_start": load_before,
        }
    wall = time.perf_counter() - t0
    val_x, val_y = byte_windows(corpus.val, seq, int(hp["val_windows"]))
    m = evaluate(model, val_x, val_y)
    metrics = {"val_bpc": m.pop("bits_per_byte"), **m}  # the records' name for bits per byte
    metrics["val_windows"] = int(val_x.shape[0])  # --val-windows is a maximum
    metrics.update(
        train_loss=hist.train_loss[-1] if hist.train_loss else math.nan,
        steps=hist.steps,
        seconds_per_step=timer.per_step(),
        train_seconds=wall,
        parameters=sum(p.numel() for p in model.parameters()),
        router_parameters=sum(p.numel() for m in model.moe_layers for p in m.router_parameters()),
        threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(),
        load_average_at_start=load_before,
    )
    return metrics
