"""Item ``gate``: per-example DSelect-k forward + backward vs the product table and Top-k.

B = 4096, p = 64, n = 128, k = 4, at initialisation and in a sparse regime (~30 % of the bits
exactly 0 or 1). ``NaiveDSelectK`` (the product-table baseline) is also used by the memory child.
"""

from __future__ import annotations

import argparse
import math
from functools import partial

import torch
from torch import Tensor, nn

from benchmarks.common import Report, dselect_out, fwd_bwd, row, topk_out
from benchmarks.timing import compare
from dselectk import functional as DF
from dselectk.gates import DSelectK, TopKGate


class NaiveDSelectK(nn.Module):
    """The straightforward per-example DSelect-k: α = Gx, Z = Wx, S, code table + where + prod.

    The entropy regulariser is computed on each n-vector r(S(Wx)) with a log, as a reader
    would first write it. Shares its fused linear layer with the fast gate under test.
    """

    def __init__(self, proj: nn.Linear, k: int, m: int, gamma: float, lam: float) -> None:
        super().__init__()
        self.proj, self.k, self.m, self.gamma, self.lam = proj, k, m, gamma, lam

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.proj(x)
        alpha, z = logits[:, : self.k], logits[:, self.k :].view(-1, self.k, self.m)
        r = DF.selector_naive(DF.smooth_step(z, self.gamma))  # (B, K, N)
        weights = (torch.softmax(alpha, dim=-1).unsqueeze(-1) * r).sum(dim=-2)
        aux = self.lam * DF.entropy(r).sum(dim=-1).mean()
        return weights, aux


def _sparse_scale(gate: DSelectK, x: Tensor, target: float = 0.3) -> float:
    """Scale of the gate's W rows that makes ~``target`` of the bits S(Wx) exactly 0 or 1."""
    lo, hi = 1.0, 1e4
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        g = DSelectK(gate.num_experts, gate.k, in_features=gate.in_features).to(x)
        g.load_state_dict(gate.state_dict())
        with torch.no_grad():
            g.proj.weight.mul_(mid)
        frac = g.binary_fraction(x)
        lo, hi = (mid, hi) if frac < target else (lo, mid)
    return math.sqrt(lo * hi)


def run(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    b, p, n, k = 4096, 64, 128, 4
    reps = 5 if args.quick else 15
    torch.manual_seed(0)
    x = torch.randn(b, p, device=dev)
    g = torch.randn(b, n, device=dev)
    rows = []
    for regime in ("init", "sparse"):
        gate = DSelectK(n, k, in_features=p, entropy_reg=0.1).to(dev)
        if regime == "sparse":
            s = _sparse_scale(gate, x)
            with torch.no_grad():
                gate.proj.weight.mul_(s)
        frac = gate.binary_fraction(x)
        naive = NaiveDSelectK(gate.proj, k, gate.num_bits, gate.gamma, 0.1)
        topk = TopKGate(n, k, in_features=p).to(dev)
        fns = {
            "ours": fwd_bwd(partial(dselect_out, gate, x), g),
            "naive": fwd_bwd(partial(naive, x), g),
            "topk": fwd_bwd(partial(topk_out, topk, x), g),
        }
        t = compare(fns, dev, reps=reps, warmup=2)
        cfg = {"B": b, "p": p, "n": n, "k": k, "binary_bits": f"{frac:.2f}"}
        rows.append(row(f"{regime}: vs product table", t, "ours", "naive", **cfg))
        rows.append(row(f"{regime}: vs top-k gate", t, "ours", "topk", **cfg))
        with torch.no_grad():
            t = compare({"ours": partial(gate, x), "topk": partial(topk, x)}, dev, reps=reps)
        rows.append(row(f"{regime}: forward only vs top-k", t, "ours", "topk", **cfg))
    rep.table(
        "gate",
        "per-example DSelect-k forward+backward (float32)",
        rows,
        "targets: >= 10x the product table (both regimes); not slower than top-k (ratio >= 1)",
    )
