"""Issue 23 screen: a dense warm-up before sparse routing (development seeds only).

Soft DSelect-k bits failed twice (``research/notes/per_token.md`` §2: γ annealed from 10; §4d: a
slower
router): while the bits are soft a token's weight is spread over more than k codes and the top-k
dispatch drops the rest, so the model trains on a mixture it does not compute. Here every MoE
layer computes the **dense** mixture Σ_e w_e E_e(x) (all experts, the gate's own weights, no
cut) for the first ``--dense`` fraction of the steps, then routes sparsely as the study does
(the dense-to-sparse idea of Nie et al. 2021, "DSelect-k"'s soft start made exact). DSelect-k
arms may anneal γ geometrically from ``--gamma-start`` to the study's γ over the same fraction,
so the bits stay soft while the mixture is dense and are binary (mostly) when the cut begins.
Top-k's dense phase uses the softmax over all n router logits (its sparse phase: the softmax
over the k largest, as always): the same remedy given to the baseline.

The balance loss is the study's in both phases (computed from the gate's weights and the top-k
dispatch counts). The routers and the rest are built as the study builds them for the seed
(``dselectk reproduce token-moe``), with ``--balance``. One JSON line per (arm, seed) on stdout.

    python scripts/screen_dense_warmup.py --router dselect_k_distinct --dense 0.3 \
        --gamma-start 10 --seeds 100 101 --balance 0.1
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import _screen as screen
import torch
from torch import Tensor

import dselectk_research.token_moe.model as tm
from dselectk.gates import TopKGate
from dselectk.layers.token_moe import SparseMoEFeedForward, TokenMoEOutput, balance_loss
from dselectk.training import Callback
from dselectk.variants import Ramp

_sparse_forward = SparseMoEFeedForward.forward
#: the dense phase is on while ``STATE["step"] < STATE["dense_steps"]``
STATE = {"step": 0, "dense_steps": 0}


def _dense_forward(self: SparseMoEFeedForward, x: Tensor) -> TokenMoEOutput:
    """The study's layer while the dense phase lasts: every expert on every token."""
    if not (self.training and STATE["step"] < STATE["dense_steps"]):
        return _sparse_forward(self, x)
    flat = x.reshape(-1, self.d_model)
    r = self.route(flat)  # the gate's weights, its aux loss and the top-k dispatch counts
    w = r.weights
    if isinstance(self.gate, TopKGate):  # the softmax over all n logits, not the top k
        w = torch.softmax(self.gate.compute_logits(flat), dim=-1)
    out = torch.einsum("tn,ntd->td", w, self.experts(flat))
    aux = r.gate_aux
    if self.balance_weight > 0:
        aux = aux + self.balance_weight * balance_loss(r.weights, r.routed)
    self.last_stats = {"load": torch.tensor(r.counts), "routed": r.routed.detach().cpu(),
                       "dropped": r.dropped, "tokens": int(flat.shape[0])}  # fmt: skip
    return TokenMoEOutput(out.reshape(x.shape), aux)


class _StepCount(Callback):
    def on_step(self, model: Any, batch: Any, out: Any, history: Any) -> None:
        STATE["step"] = history.steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--router", default="dselect_k_distinct", choices=list(tm.ROUTERS))
    p.add_argument("--dense", type=float, required=True, help="fraction of the steps dense")
    p.add_argument("--gamma-start", type=float, default=None, help="DSelect-k: γ at step 0")
    screen.add_arguments(p)
    a = p.parse_args()
    if not 0.0 <= a.dense < 1.0:
        p.error(f"--dense {a.dense}: expected a fraction in [0, 1)")
    variant = tm.ROUTERS[a.router]
    if a.gamma_start is not None:
        if variant.gate != "dselect_k":
            p.error("--gamma-start: DSelect-k routers only")
        ramp = Ramp("gamma", start=a.gamma_start, span=a.dense, shape="geometric")
        variant = dataclasses.replace(variant, schedules=(ramp,))
    hp, corpus = screen.settings(p, a)
    SparseMoEFeedForward.forward = _dense_forward  # type: ignore[method-assign]
    for seed in a.seeds:
        STATE.update(step=0, dense_steps=int(a.dense * a.steps))
        fields = {"router": a.router, "dense": a.dense, "gamma_start": a.gamma_start,
                  "seed": seed, "balance": a.balance, "steps": a.steps}  # fmt: skip
        screen.run(fields, variant, hp, corpus, seed, [_StepCount()], extra=("train_seconds",))


if __name__ == "__main__":
    main()
