"""Issue 23 screen: selector weights coupled to the bits' margins (development seeds only).

Per-token DSelect-k has no way to drop a selector's expert once its bits are binary (§1 of
``research/notes/per_token.md``): σ(α) re-weighs a token's k selectors, as Top-k's softmax
re-weighs its k
experts, but a lower α never moves a code, while Top-k demotes an expert whose logit falls below
a competitor's. Here α_i gets κ times the selector's mean margin Σ_j |z_ij| / (M γ/2): the
gradient that lowers a less useful selector's weight also pulls its bits towards the smooth
region, where its code can move; a useful selector's bits are pushed further out. κ = 0 is the
study's gate exactly (the same autograd path as with distinct codes, which never take the
kernels). Everything else is the study's default model and training (``dselectk reproduce
token-moe``) with ``--balance``; the routers are built as usual and only their class is swapped
(the same parameters and random draws as the study's run of the same seed).
One JSON line per (κ, seed) on stdout.

    python scripts/screen_margin_alpha.py --kappa 0.5 2 --seeds 100 101 --balance 0.1
"""

from __future__ import annotations

import argparse
from typing import Any

import _screen as screen
from torch import Tensor

import dselectk_research.token_moe.model as tm
from dselectk.gates import DSelectK, GateOutput


class MarginDSelectK(DSelectK):
    """DSelect-k whose selector logits are α + κ · mean_j |z_ij| / (γ/2)."""

    kappa = 0.0

    def gate(self, logits: Tensor) -> GateOutput:
        alpha, z = self.split_logits(logits)
        margin = z.abs().mean(dim=-1) / (self._gamma / 2)  # (*lead, K)
        return self._gate_parts(alpha + self.kappa * margin, z)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kappa", type=float, nargs="+", required=True)
    p.add_argument("--router", default="dselect_k_distinct", choices=list(tm.ROUTERS))
    screen.add_arguments(p)
    a = p.parse_args()
    hp, corpus = screen.settings(p, a)
    build = tm.build_model
    for kappa in a.kappa:

        def swapped(variant: Any, hp: Any, kappa: float = kappa) -> Any:
            model = build(variant, hp)
            for layer in model.moe_layers:
                assert type(layer.gate) is DSelectK
                layer.gate.__class__ = MarginDSelectK
                layer.gate.kappa = kappa
            return model

        tm.build_model = swapped
        for seed in a.seeds:
            fields = {"router": a.router, "kappa": kappa, "seed": seed, "balance": a.balance,
                      "steps": a.steps}  # fmt: skip
            screen.run(fields, tm.ROUTERS[a.router], hp, corpus, seed)


if __name__ == "__main__":
    main()
