"""Issue 23 screen: router re-smoothing on the token-moe char-LM (development seeds only).

At the given fractions of the run, every MoE layer's router parameters are multiplied by
``--factor`` (z = Wx + b shrinks towards 0, where DSelect-k's smooth-step is not flat, so a
token's expert choice can learn again; Top-k's softmax gets flatter). Everything else is the
study's default model and training (``dselectk reproduce token-moe``), with ``--balance``.
One JSON line per (router, seed) on stdout.

    python scripts/screen_router_resmooth.py --factor 0.25 --at 0.25 0.5 \
        --routers dselect_k_distinct topk --seeds 100 101 --balance 0.1
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

from dselectk.data.text import load_corpus
from dselectk.experiments.token_moe.model import ROUTERS, train_run
from dselectk.experiments.token_moe.recipe import DEFAULTS
from dselectk.training import Callback, History, TaskData


class Resmooth(Callback):
    """Multiplies every MoE layer's router parameters by ``factor`` after the given steps."""

    def __init__(self, factor: float, steps: set[int]) -> None:
        self.factor, self.steps = factor, steps

    def on_step(self, model: Any, batch: TaskData, out: Any, history: History) -> None:
        if history.steps in self.steps:
            with torch.no_grad():
                for layer in model.moe_layers:
                    for p in layer.router.parameters():
                        p.mul_(self.factor)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--factor", type=float, required=True)
    p.add_argument("--at", type=float, nargs="+", required=True, help="fractions of the run")
    p.add_argument("--routers", nargs="+", choices=list(ROUTERS), required=True)
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--balance", type=float, default=DEFAULTS["balance_loss_weight"])
    a = p.parse_args()
    reserved = [s for s in a.seeds if s < 100 or s >= 1000]
    if reserved:
        p.error(f"--seeds {reserved}: reserved for reported runs; screen on 100-999 only")
    torch.set_num_threads(1)
    hp = {**DEFAULTS, "heads": 4, "balance_loss_weight": a.balance}
    marks = {round(f * int(hp["steps"])) for f in a.at}
    corpus = load_corpus(hp["corpus_bytes"], hp["val_fraction"])
    for router in a.routers:
        for seed in a.seeds:
            load = os.getloadavg()[0]
            m = train_run(
                ROUTERS[router], hp, corpus, seed, progress=False, desc="",
                callbacks=[Resmooth(a.factor, marks)],
            )  # fmt: skip
            print(json.dumps({
                "router": router, "seed": seed, "factor": a.factor, "at": a.at,
                "balance": a.balance, "val_bpc": m["val_bpc"],
                "experts_per_token": m.get("dispatched_experts_per_token"),
                "binary_tokens": m.get("binary_token_fraction"),
                "load_max_over_mean": m.get("load_max_over_mean"), "load_average": load,
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
