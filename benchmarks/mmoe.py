"""Item ``mmoe``: a MovieLens-architecture multi-gate MoE training step vs a plain PyTorch MMoE.

The baseline runs its experts in a Python loop, has one gate module per task and uses default
Adam. ``ours_mmoe``, ``train_step`` and ``adam`` are shared with the ``conditional`` item.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common import Report, row
from benchmarks.timing import compare
from dselectk.gates import DSelectK
from dselectk.layers import StackedMLP
from dselectk.models import MultiGateMoE


def ours_mmoe(
    dev: torch.device,
    n: int = 8,
    tasks: int = 2,
    conditional: bool = True,
    tower: tuple[int, ...] = (256, 1),
) -> Any:
    """Our MMoE: n Dense-256 experts on 64 features, a static DSelect-k (k=2) bank, towers."""
    torch.manual_seed(0)
    return MultiGateMoE(
        StackedMLP(n, 64, [256], final_activation=True),
        DSelectK(n, 2, num_gates=tasks),
        StackedMLP(tasks, 256, list(tower), final_activation=False),
        conditional=conditional,
    ).to(dev)


class LoopMMoE(nn.Module):
    """A straightforward PyTorch MMoE: experts in a Python loop, one gate module per task."""

    def __init__(self, n: int = 8, tasks: int = 2) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.ReLU()) for _ in range(n))
        self.gates = nn.ModuleList(DSelectK(n, 2) for _ in range(tasks))
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)) for _ in range(tasks)
        )

    def forward(self, x: Tensor) -> tuple[list[Tensor], Tensor]:
        expert_out = torch.stack([e(x) for e in self.experts], dim=-1)  # (B, D, n)
        outs, aux = [], x.new_zeros(())
        for gate, tower in zip(self.gates, self.towers):
            o = gate()
            outs.append(tower(expert_out @ o.weights))
            aux = aux + o.aux_loss
        return outs, aux


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, ys: list[Tensor]
) -> Callable[[], None]:
    """One MSE training step over all task outputs plus the auxiliary loss."""

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = model(x)
        outs, aux = (out.outputs, out.aux_loss) if hasattr(out, "outputs") else out
        loss = sum(F.mse_loss(o, y) for o, y in zip(outs, ys)) + aux
        loss.backward()
        opt.step()

    return step


def adam(params: Any, dev: torch.device) -> torch.optim.Optimizer:
    """Fused Adam where this torch supports it on the device, else foreach."""
    try:
        return torch.optim.Adam(params, lr=1e-3, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.Adam(params, lr=1e-3, foreach=True)


def run(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    batch = 128
    torch.manual_seed(1)
    x = torch.randn(batch, 64, device=dev)
    ys = [torch.randn(batch, 1, device=dev) for _ in range(2)]
    ours = ours_mmoe(dev)
    ours_step = train_step(ours, adam(ours.parameters(), dev), x, ys)
    ours_foreach = ours_mmoe(dev)
    opt_fe = torch.optim.Adam(ours_foreach.parameters(), lr=1e-3, foreach=True)
    ours_fe_step = train_step(ours_foreach, opt_fe, x, ys)
    base = LoopMMoE().to(dev)
    base_step = train_step(base, torch.optim.Adam(base.parameters(), lr=1e-3), x, ys)
    fns = {"ours": ours_step, "ours_foreach": ours_fe_step, "base": base_step}
    if args.compile:
        comp = ours_mmoe(dev)
        opt_c = adam(comp.parameters(), dev)
        fns["ours_compiled"] = torch.compile(train_step(comp, opt_c, x, ys))
        t0 = time.perf_counter()
        for _ in range(3):
            fns["ours_compiled"]()
        print(f"   (torch.compile warm-up {time.perf_counter() - t0:.1f} s)")
    t = compare(fns, dev, reps=20 if args.quick else 100, warmup=10, min_time=0.5)
    cfg = {"experts": "8x Dense256+ReLU", "tasks": 2, "gate": "static DSelect-k k=2"}
    rows = [
        row("ours (fused Adam)", t, "ours", "base", batch=batch, **cfg),
        row("ours (foreach Adam)", t, "ours_foreach", "base", batch=batch),
    ]
    if args.compile:
        rows.append(row("ours, torch.compile(step)", t, "ours_compiled", "base", batch=batch))
    for r in rows:
        r["ours_steps_per_s"] = 1e3 / r["ours_ms"]
        r["base_steps_per_s"] = 1e3 / r["base_ms"]
    rep.table(
        "mmoe",
        "MMoE training step, MovieLens architecture (baseline: loop experts, default Adam)",
        rows,
        "target: ratio (= steps/s ours / steps/s baseline) >= 1.5",
    )
