"""The token-MoE study's routers (one :class:`~dselectk.variants.Variant` each) and one
training run of :class:`~dselectk_research.char_lm.CharMoETransformer` on the
:mod:`~dselectk_research.data.text` corpus."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dselectk.gates.base import Gate
from dselectk.telemetry import RoutingTelemetry
from dselectk.training import (
    Callback,
    TaskData,
    TrainConfig,
    TrainingDivergedError,
    train,
)
from dselectk.variants import Variant
from dselectk_research.catalog import select
from dselectk_research.char_lm import CharMoETransformer, byte_windows, evaluate, random_windows
from dselectk_research.data.text import Corpus
from dselectk_research.executors import progress_position
from dselectk_research.monitor import StepTimer

EXPERIMENT = "token-moe"

#: the routers compared (``--gates``; :mod:`dselectk_research.catalog`); DSelect-k takes the
#: study's ``gamma`` and ``entropy_reg``
ROUTERS = select(
    "dselect_k",
    "topk",
    "dselect_k_distinct",
    "dselect_k_diversity",
    "expert_choice",
    renamed={"dselect_k": "dselect_k_token"},
)
#: the registry names of the DSelect-k gates (``router_k`` sets their selector count)
DSELECT_K_GATES = ("dselect_k", "dselect_k_extended")
#: the routers a command runs without ``--gates`` (expert choice sees the whole batch, future
#: tokens included: a competitor to run on purpose, not a default)
DEFAULT_ROUTERS = tuple(name for name, v in ROUTERS.items() if v.routing == "token")
#: optimizer steps the step timer leaves out (warm-up)
WARMUP_STEPS = 10


def build_model(variant: Variant, hp: Mapping[str, Any]) -> CharMoETransformer:
    """The study's transformer, every MoE layer routed by a gate of ``variant`` (with the
    gate's hyperparameters found in ``hp``). ``hp["router_k"]`` (when set): a DSelect-k
    router's number of selectors; the layer still dispatches ``hp["k"]`` experts a token."""
    gate: Callable[..., Gate] = partial(variant.build, hparams=hp)
    if hp.get("router_k") is not None and variant.gate in DSELECT_K_GATES:
        gate = partial(_selectors, variant, hp)
    return CharMoETransformer.from_settings(gate, hp, routing=variant.routing)


def _selectors(variant: Variant, hp: Mapping[str, Any], num_experts: int, **structure: Any) -> Gate:
    """``variant``'s gate with ``hp["router_k"]`` selectors (in place of the layer's k)."""
    return variant.build(num_experts, hparams=hp, **{**structure, "k": int(hp["router_k"])})


def _lm_loss(model: Any, batch: TaskData) -> tuple[Tensor, None]:
    return model.loss(batch.x, batch.ys[0]), None


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
    ``telemetry_dir``: routing telemetry, 20 times over the run; ``callbacks``: passed on to
    :func:`~dselectk.training.train`."""
    torch.manual_seed(seed)
    model = build_model(variant, hp)
    seq, steps = int(hp["seq_len"]), int(hp["steps"])
    # random windows (one draw per run seed): every run sees other cuts of the text
    g = torch.Generator().manual_seed(seed)
    x, y = random_windows(corpus.train, seq, steps * int(hp["batch_size"]), g)
    timer = StepTimer(WARMUP_STEPS)
    callbacks = [timer, *(callbacks or [])]
    # the variant's ramps (γ, λ, ...), one scheduler per MoE layer's router
    scheds: list[Any] = [s for m in model.moe_layers for s in variant.schedulers(m.gate, hp, steps)]
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
        search=None,  # the study's own settings: no swap search
    )
    machine: dict[str, Any] = {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    machine["load_average_at_start"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    t0 = time.perf_counter()
    try:
        hist = train(
            model,
            TaskData(x, [y]),
            None,
            cfg,
            schedulers=scheds,
            callbacks=callbacks,
            loss_fn=_lm_loss,
        )
    except TrainingDivergedError as e:  # recorded as diverged: counted, never averaged
        return {
            "val_bpc": math.nan,
            "train_loss": math.nan,
            "diverged_at_step": e.step,
            "diverged_because": str(e),
            **machine,
        }
    wall = time.perf_counter() - t0
    val_x, val_y = byte_windows(corpus.val, seq, int(hp["val_windows"]))
    m = evaluate(model, val_x, val_y)
    return {
        "val_bpc": m.pop("bits_per_byte"),  # the records' name for bits per byte
        **m,
        "val_windows": int(val_x.shape[0]),  # --val-windows is a maximum
        "train_loss": hist.train_loss[-1] if hist.train_loss else math.nan,
        "steps": hist.steps,
        "seconds_per_step": timer.per_step(),
        "train_seconds": wall,
        "parameters": sum(p.numel() for p in model.parameters()),
        "router_parameters": sum(p.numel() for p in model.router_parameters()),
        **machine,
    }
