"""Item ``conditional``: conditional computation, sparse path vs dense path.

Training step with binary static gates vs the dense step; per-example routing at inference vs
a dense model of only the selected experts (and vs all experts).
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor

from benchmarks.common import Report, row
from benchmarks.mmoe import adam, ours_mmoe, train_step
from benchmarks.timing import compare
from dselectk.gates import DSelectK, DSelectKExtended
from dselectk.layers import StackedMLP
from dselectk.models import MoE


def _binarize_static(gate: DSelectK, codes: list[list[int]]) -> None:
    """Set Z = ±γ so that S(Z) is binary and selector i of gate t picks expert codes[t][i]."""
    c = torch.tensor(codes, device=gate.z.device)
    bits = (c.unsqueeze(-1) >> torch.arange(gate.num_bits, device=c.device)) & 1
    with torch.no_grad():
        gate.z.copy_((bits.to(gate.z.dtype) * 2 - 1) * gate.gamma)


def _train_rows(dev: torch.device, quick: bool) -> list[dict]:
    # The paper's MovieLens towers (Dense 256 -> 1 per task) cost as much as all 8 experts,
    # so they bound what skipping experts can save; linear task heads (256 -> 1) isolate the
    # MoE layer, where conditional computation acts. At the paper's batch of 128, fixed
    # per-step costs (gates, Adam over all parameters, op dispatch) dominate; a larger batch
    # shows the compute-bound regime.
    usage = {"disjoint (4 of 8 experts used)": [[0, 1], [2, 3]], "shared (2 of 8)": [[0, 1]] * 2}
    towers = {"towers 256-256-1": (256, 1), "linear heads 256-1": (1,)}
    batches = (128,) if quick else (128, 2048)
    cases = [
        (f"{u}, {tn}", codes, tower, batch)
        for batch in batches
        for tn, tower in towers.items()
        for u, codes in usage.items()
    ]
    rows = []
    for name, codes, tower, batch in cases:
        torch.manual_seed(1)
        x = torch.randn(batch, 64, device=dev)
        ys = [torch.randn(batch, 1, device=dev) for _ in range(2)]
        sparse = ours_mmoe(dev, tower=tower)
        assert isinstance(sparse.gates, DSelectK)
        _binarize_static(sparse.gates, codes)
        dense = ours_mmoe(dev, conditional=False, tower=tower)
        dense.load_state_dict(sparse.state_dict())
        fns = {
            "sparse": train_step(sparse, adam(sparse.parameters(), dev), x, ys),
            "dense": train_step(dense, adam(dense.parameters(), dev), x, ys),
        }
        t = compare(fns, dev, reps=20 if quick else 60, warmup=5, min_time=0.5)
        r = row(f"train, {name}", t, "sparse", "dense", batch=batch, tasks=2, k=2)
        r["ours_over_dense"] = r["ours_ms"] / r["base_ms"]
        rows.append(r)
    return rows


def _inference_rows(dev: torch.device, quick: bool) -> list[dict]:
    """Per-example gate at inference: routed vs a dense model of the k selected experts."""
    b, n, k = (1024 if quick else 4096), 8, 2
    torch.manual_seed(2)
    xi = torch.randn(b, 64, device=dev)
    gate = DSelectKExtended(n, k, in_features=64, init="spread").to(dev)
    with torch.no_grad():
        gate.proj.weight.mul_(1e3)  # every bit binary: each example uses <= k experts
    experts = StackedMLP(n, 64, [256], final_activation=True).to(dev)
    routed = MoE(experts, gate).eval()
    dense_all = MoE(experts, gate, conditional=False).eval()
    # a dense model of only k experts
    selected = StackedMLP(k, 64, [256], final_activation=True).to(dev)

    def dense_selected() -> Tensor:
        w = gate(xi).weights[:, :k].unsqueeze(1)  # same gate cost, k columns
        return torch.bmm(w, selected(xi).transpose(0, 1))[:, 0]

    used = float((gate(xi).weights != 0).sum(-1).double().mean())
    with torch.no_grad():
        t = compare(
            {
                "routed": lambda: routed(xi),
                "selected": dense_selected,
                "all": lambda: dense_all(xi),
            },
            dev,
            reps=10 if quick else 40,
            warmup=3,
        )
    r = row("inference, routed vs k-expert dense", t, "routed", "selected", B=b, n=n, k=k)
    r["ours_over_selected"] = r["ours_ms"] / r["base_ms"]
    r["experts_per_example"] = used
    return [r, row("inference, routed vs all-expert dense", t, "routed", "all", B=b, n=n, k=k)]


def run(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    rows = _train_rows(dev, args.quick) + _inference_rows(dev, args.quick)
    rep.table(
        "conditional",
        "conditional computation (ours: sparse path; base: dense path)",
        rows,
        "targets: train step ours/dense <= 0.6 (ratio >= 1.67); inference routed <= 1.2x the "
        "k-expert dense model (ratio >= 0.83)",
    )
