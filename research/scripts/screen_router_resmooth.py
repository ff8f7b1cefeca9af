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
from typing import Any

import _screen as screen
import torch

from dselectk.training import Callback, History, TaskData
from dselectk_research.token_moe.model import ROUTERS


class Resmooth(Callback):
    """Multiplies every MoE layer's router parameters by ``factor`` after the given steps."""

    def __init__(self, factor: float, steps: set[int]) -> None:
        self.factor, self.steps = factor, steps

    def on_step(self, model: Any, batch: TaskData, out: Any, history: History) -> None:
        if history.steps in self.steps:
            with torch.no_grad():
                for layer in model.moe_layers:
                    for p in layer.gate.parameters():
                        p.mul_(self.factor)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--factor", type=float, required=True)
    p.add_argument("--at", type=float, nargs="+", required=True, help="fractions of the run")
    p.add_argument("--routers", nargs="+", choices=list(ROUTERS), required=True)
    screen.add_arguments(p, steps=False)
    a = p.parse_args()
    hp, corpus = screen.settings(p, a)
    marks = {round(f * int(hp["steps"])) for f in a.at}
    for router in a.routers:
        for seed in a.seeds:
            fields = {"router": router, "seed": seed, "factor": a.factor, "at": a.at,
                      "balance": a.balance}  # fmt: skip
            screen.run(fields, ROUTERS[router], hp, corpus, seed, [Resmooth(a.factor, marks)])


if __name__ == "__main__":
    main()
