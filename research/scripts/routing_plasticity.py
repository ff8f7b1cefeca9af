"""Issue 23 diagnostic: how long does each router keep re-routing tokens? (development seeds)

Trains the token-moe study's char-LM (its defaults, ``--balance``) with one router and, every
``--every`` steps, records each MoE layer's dispatched expert set (the k experts of largest
weight) for a fixed probe of 4,096 validation tokens. Per layer and checkpoint:

- ``changed``: fraction of probe tokens whose set differs from the previous checkpoint's;
- ``final``: fraction whose set already equals the set at the end of the run.

Top-k can demote an expert at any step (its softmax over the chosen logits lowers the weaker
one until a competitor overtakes it); a DSelect-k token's codes stop moving once its bits are
binary (``research/notes/per_token.md`` §1). This measures the difference. One JSON object per
router on
stdout (``--out`` also writes them).

    python scripts/routing_plasticity.py --routers topk dselect_k_distinct --seed 100 --balance 0.1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from diagnose_token_collapse import router_io  # (scripts/ is on the path when run as a script)
from torch import Tensor, nn

from dselectk.training import Callback, History, TaskData
from dselectk_research.char_lm import byte_windows
from dselectk_research.data.text import load_corpus
from dselectk_research.token_moe.model import ROUTERS, train_run
from dselectk_research.token_moe.recipe import DEFAULTS


class Plasticity(Callback):
    """Each MoE layer's dispatched expert sets on ``probe`` every ``every`` steps."""

    def __init__(self, probe: Tensor, every: int, k: int) -> None:
        self.probe, self.every, self.k = probe, every, k
        self.steps: list[int] = []
        self.sets: list[list[Tensor]] = []  # per checkpoint, per layer: (tokens, k) sorted

    def on_step(self, model: nn.Module, batch: TaskData, out: Any, history: History) -> None:
        if history.steps % self.every and history.steps != 1:
            return
        self.steps.append(history.steps)
        self.sets.append(
            [
                o.weights.topk(self.k, dim=-1).indices.sort(-1).values
                for _, o in router_io(model, self.probe)
            ]
        )

    def table(self) -> list[dict[str, Any]]:
        final = self.sets[-1]
        rows = []
        for i, (step, sets) in enumerate(zip(self.steps, self.sets, strict=True)):
            for layer, s in enumerate(sets):
                same_final = (s == final[layer]).all(-1).float().mean()
                changed = float("nan")
                if i:
                    changed = float((s != self.sets[i - 1][layer]).any(-1).float().mean())
                rows.append(
                    {"step": step, "layer": layer, "changed": changed, "final": float(same_final)}
                )
        return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--routers", nargs="+", choices=list(ROUTERS), required=True)
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--balance", type=float, default=DEFAULTS["balance_loss_weight"])
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    if not 100 <= a.seed < 1000:
        p.error(f"--seed {a.seed}: reserved for reported runs; use 100-999")
    torch.set_num_threads(1)
    hp = {**DEFAULTS, "heads": 4, "balance_loss_weight": a.balance}
    corpus = load_corpus(int(hp["corpus_bytes"]), float(hp["val_fraction"]))
    probe = byte_windows(corpus.val, int(hp["seq_len"]), 64)[0]  # 64 windows: 4,096 tokens
    results = []
    for router in a.routers:
        watch = Plasticity(probe, a.every, int(hp["k"]))
        m = train_run(
            ROUTERS[router], hp, corpus, a.seed, progress=False, desc="", callbacks=[watch]
        )
        res = {"router": router, "seed": a.seed, "balance": a.balance, "val_bpc": m["val_bpc"]}
        res["rows"] = watch.table()
        print(json.dumps(res), flush=True)
        results.append(res)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
