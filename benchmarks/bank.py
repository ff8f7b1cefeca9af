"""Item ``bank``: T static gates as one ``num_gates=T`` module vs T modules, T = 2, 16, 128."""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn

from benchmarks.common import Report, row
from benchmarks.timing import compare
from dselectk.gates import DSelectK


def run(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    n, k = 8, 2
    rows = []
    for t_gates in (2, 16, 128):
        torch.manual_seed(0)
        bank = DSelectK(n, k, num_gates=t_gates, entropy_reg=0.1).to(dev)
        singles = nn.ModuleList(DSelectK(n, k, entropy_reg=0.1) for _ in range(t_gates)).to(dev)
        g = torch.randn(t_gates, n, device=dev)

        def ours(bank: DSelectK = bank, g: Tensor = g) -> None:
            o = bank()
            ((o.weights * g).sum() + o.aux_loss).backward()

        def base(singles: nn.ModuleList = singles, g: Tensor = g) -> None:
            outs = [gate() for gate in singles]
            w = torch.stack([o.weights for o in outs])
            aux = torch.stack([o.aux_loss for o in outs]).sum()
            ((w * g).sum() + aux).backward()

        reps = 10 if args.quick else 30
        t = compare({"ours": ours, "base": base}, dev, reps=reps, min_time=0.2)
        rows.append(row(f"T={t_gates}", t, "ours", "base", n=n, k=k, static="yes"))
    rep.table(
        "bank",
        "T static gates per step (forward+backward): one num_gates=T module vs T modules",
        rows,
    )
