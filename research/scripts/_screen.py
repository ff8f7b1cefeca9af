"""What the issue-23 screen scripts share: development seeds only (100-999), the study's
default settings (``dselectk reproduce token-moe``) with ``--balance`` on one thread, its corpus,
and one JSON line per run with the routing figures of the run's metrics."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

import dselectk_research.token_moe.model as tm
from dselectk.variants import Variant
from dselectk_research.data.text import Corpus, load_corpus
from dselectk_research.token_moe.recipe import DEFAULTS


def add_arguments(p: argparse.ArgumentParser, *, steps: bool = True) -> None:
    """``--seeds`` (development seeds), ``--balance`` and, with ``steps``, ``--steps``."""
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--balance", type=float, default=DEFAULTS["balance_loss_weight"])
    if steps:
        p.add_argument("--steps", type=int, default=DEFAULTS["steps"])


def settings(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[dict[str, Any], Corpus]:
    """The study's settings for the parsed flags and its corpus; refuses the reported seeds."""
    reserved = [s for s in a.seeds if s < 100 or s >= 1000]
    if reserved:
        p.error(f"--seeds {reserved}: reserved for reported runs; screen on 100-999 only")
    torch.set_num_threads(1)
    hp = {**DEFAULTS, "heads": 4, "balance_loss_weight": a.balance}
    if getattr(a, "steps", None) is not None:
        hp["steps"] = a.steps
    return hp, load_corpus(hp["corpus_bytes"], hp["val_fraction"])


def run(
    fields: dict[str, Any],
    variant: Variant,
    hp: dict[str, Any],
    corpus: Corpus,
    seed: int,
    callbacks: Iterable[Any] = (),
    extra: Sequence[str] = (),
) -> None:
    """Train one study run (``tm.train_run``, looked up at call time so that a script may swap
    ``tm.build_model``) and print ``fields``, its bits per byte and routing figures, the load
    at its start and the metrics named in ``extra`` as one JSON line."""
    load = os.getloadavg()[0]
    m = tm.train_run(variant, hp, corpus, seed, progress=False, desc="", callbacks=list(callbacks))
    print(json.dumps({
        **fields, "val_bpc": m["val_bpc"],
        "experts_per_token": m.get("dispatched_experts_per_token"),
        "binary_tokens": m.get("binary_token_fraction"),
        "nonzero_per_token": m.get("experts_per_token"),
        "load_max_over_mean": m.get("load_max_over_mean"), "load_average": load,
        **{k: m.get(k) for k in extra},
    }), flush=True)  # fmt: skip
