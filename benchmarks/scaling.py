"""Item ``scaling``: per-example gate fwd+bwd cost against n and B (k = 4, p = 64), vs Top-k."""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.common import Report, dselect_out, fwd_bwd, row, topk_out
from benchmarks.timing import compare
from dselectk.gates import DSelectK, TopKGate


def run(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    rows = []
    p, k = 64, 4
    for b in (256, 4096):
        for n in (8, 32, 128, 512, 1024):
            torch.manual_seed(0)
            x = torch.randn(b, p, device=dev)
            g = torch.randn(b, n, device=dev)
            gate = DSelectK(n, k, in_features=p, entropy_reg=0.1).to(dev)
            topk = TopKGate(n, k, in_features=p).to(dev)
            t = compare(
                {
                    "ours": fwd_bwd(partial(dselect_out, gate, x), g),
                    "topk": fwd_bwd(partial(topk_out, topk, x), g),
                },
                dev,
                reps=5 if args.quick else 15,
                warmup=2,
                min_time=0.1,
            )
            r = row(f"B={b} n={n}", t, "ours", "topk", baseline="top-k")
            r["ns_per_example_expert"] = r["ours_ms"] * 1e6 / (b * n)
            r["config"] += f" ns/(example*expert)={r['ns_per_example_expert']:.2f}"
            rows.append(r)
    rep.table(
        "scaling",
        "per-example gate fwd+bwd against n and B (k=4, p=64); baseline: top-k gate",
        rows,
        "linear in n: ns per (example*expert) should stay flat as n grows",
    )
