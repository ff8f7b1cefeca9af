"""Why per-token DSelect-k's selectors collide (issue 23): trains the token-moe study's char-LM
with one router and watches every MoE layer's router on a fixed probe of validation tokens.

Recorded at 25 points of the run, per layer (k = 2 selectors; more are compared pairwise):

- ``collide``: fraction of probe tokens whose selectors pick the same code (the token gets one
  expert where it should get k);
- ``binary``: fraction of probe tokens whose bits S(Wx) are all 0 or 1 (no gradient reaches
  their selector rows from those tokens: the smooth-step is flat there);
- ``binary_when_collide``: of the colliding tokens, the fraction already binary (frozen);
- ``top_pair_share``: of the colliding tokens, the share of the most common code (1.0: every
  collision on one code, a global collapse; ~1/n: spread over codes, per input);
- ``codes_used``: distinct codes selector 1 uses over the probe (the routing's diversity);
- ``cos_w``: cosine similarity of the two selectors' Z projections (the M×d rows of W⁽¹⁾ and
  W⁽²⁾ flattened; 1: lockstep, the same function of the token);
- ``z_over_half_gamma``: median |Wx + b| / (γ/2) over probe bits (> 1: binary);
- ``grad_ratio``: gradient norm on selector 2's Z rows over selector 1's, at that step.

Usage::

    python scripts/diagnose_token_collapse.py --router dselect_k --seed 100 --steps 1000 \\
        --out research/results/token_collapse/dselect_k_seed100.json

Prints a table and writes the records as JSON. Development seeds only (100+): the study's
reported seeds are 0, 1, 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dselectk.training import Callback, History, TaskData
from dselectk_research.char_lm import byte_windows
from dselectk_research.data.text import load_corpus
from dselectk_research.token_moe.model import ROUTERS, train_run
from dselectk_research.token_moe.recipe import DEFAULTS


def _codes(z: Tensor) -> Tensor:
    return ((z > 0).long() * 2 ** torch.arange(z.shape[-1])).sum(-1)


def router_io(model: nn.Module, probe: Tensor) -> list[tuple[Tensor, Any]]:
    """(input, output) of every MoE layer's router when ``model`` (in eval mode, no grad) reads
    ``probe``; the model's training mode is restored."""
    seen: list[tuple[Tensor, Any]] = []
    layers = model.moe_layers  # type: ignore[attr-defined]
    hooks = [m.gate.register_forward_hook(lambda m, a, o: seen.append((a[0], o))) for m in layers]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(probe)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    return seen


class Diagnosis(Callback):
    """Watches each MoE layer's router on ``probe`` (W, L) bytes every ``every`` steps."""

    def __init__(self, probe: Tensor, every: int) -> None:
        self.probe, self.every = probe, every
        self.records: list[dict[str, Any]] = []

    def on_step(self, model: nn.Module, batch: TaskData, out: Any, history: History) -> None:
        if history.steps % self.every and history.steps != 1:
            return
        layers = model.moe_layers  # type: ignore[attr-defined]
        grads = [self._grad_ratio(m.gate) for m in layers]
        seen = [x for x, _ in router_io(model, self.probe)]
        rec: dict[str, Any] = {"step": history.steps, "layers": []}
        for m, x, g in zip(layers, seen, grads, strict=True):
            rec["layers"].append({**self._measure(m.gate, x), "grad_ratio": g})
        self.records.append(rec)

    @staticmethod
    def _grad_ratio(gate: Any) -> float:
        w = gate.proj.weight.grad
        if w is None:
            return float("nan")
        k, m = gate.k, gate.num_bits
        zrows = w[k:].view(k, m, -1)
        norms = zrows.flatten(1).norm(dim=1)
        return float(norms[1] / norms[0]) if float(norms[0]) > 0 else float("nan")

    @staticmethod
    @torch.no_grad()
    def _measure(gate: Any, x: Tensor) -> dict[str, float]:
        _, z = gate.split_logits(gate.compute_logits(x))
        z = gate._codes_z(z)  # what the gate uses (distinct codes when on)
        gamma = float(gate.gamma)
        binary = (z.abs() >= gamma / 2).flatten(-2).all(-1)  # (N,)
        codes = _codes(z)  # (N, K)
        collide = codes[:, 0] == codes[:, 1]
        share = 0.0
        if bool(collide.any()):
            share = float(torch.bincount(codes[collide, 0]).max() / collide.sum())
        k, m = gate.k, gate.num_bits
        w = gate.proj.weight[k:].view(k, m, -1).flatten(1)  # (K, M·d)
        cos = float(torch.nn.functional.cosine_similarity(w[0], w[1], dim=0))
        return {
            "collide": float(collide.float().mean()),
            "binary": float(binary.float().mean()),
            "binary_when_collide": float(binary[collide].float().mean())
            if bool(collide.any())
            else float("nan"),
            "top_pair_share": share,
            "codes_used": float(codes[:, 0].unique().numel()),
            "cos_w": cos,
            "z_over_half_gamma": float((z.abs() / (gamma / 2)).median()),
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default="dselect_k", choices=[r for r in ROUTERS if r != "topk"])
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--steps", type=int, default=int(DEFAULTS["steps"]))
    p.add_argument("--gamma", type=float, default=float(DEFAULTS["gamma"]))
    p.add_argument("--entropy-reg", type=float, default=float(DEFAULTS["entropy_reg"]))
    p.add_argument("--out", type=Path, default=None, help="write the records here (JSON)")
    a = p.parse_args(argv)
    if a.seed < 100:
        print("--seed: use development seeds (>= 100); 0-2 are the study's", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    hp = {**DEFAULTS, "steps": a.steps, "gamma": a.gamma, "entropy_reg": a.entropy_reg}
    corpus = load_corpus(int(hp["corpus_bytes"]), float(hp["val_fraction"]))
    probe = byte_windows(corpus.val, int(hp["seq_len"]), 64)[0]  # 64 windows: 4096 tokens
    diag = Diagnosis(probe, every=max(1, a.steps // 25))
    metrics = train_run(
        ROUTERS[a.router], hp, corpus, a.seed, progress=False, desc=a.router, callbacks=[diag]
    )
    keys = list(diag.records[-1]["layers"][0])
    print(f"{a.router} seed {a.seed}: val bits/byte {metrics['val_bpc']:.4f}, distinct experts "
          f"per token {metrics['dispatched_experts_per_token']:.3f}")  # fmt: skip
    print(f"{'step':>6} {'layer':>5} " + " ".join(f"{k:>19}" for k in keys))
    for rec in diag.records:
        for i, layer in enumerate(rec["layers"]):
            print(f"{rec['step']:>6} {i:>5} " + " ".join(f"{layer[k]:>19.3f}" for k in keys))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: str(v) for k, v in vars(a).items()}, "hparams": hp}
        payload.update(metrics=metrics, records=diag.records)
        a.out.write_text(json.dumps(payload, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
