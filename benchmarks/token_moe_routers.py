"""Training tokens per second of the token-moe study's routers, side by side (issue 23).

One training step (forward, backward, Adam) of the study's char-LM
(:func:`dselectk_research.token_moe.model.build_model`, default settings) with each router,
timed interleaved in one process by :func:`benchmarks.timing.compare` (round robin, medians), on
random byte windows. Ratios to Top-k are what to read; the load average is printed.

Run: ``python -m benchmarks.token_moe_routers [--threads 1] [--reps 15]``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

from benchmarks.timing import compare
from dselectk_research.token_moe.model import ROUTERS, build_model
from dselectk_research.token_moe.recipe import DEFAULTS


def step_fn(router: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One optimizer step of the study's model with ``router`` on the batch (x, y)."""
    torch.manual_seed(0)
    model = build_model(ROUTERS[router], DEFAULTS)
    opt = torch.optim.Adam(model.parameters(), lr=float(DEFAULTS["lr"]))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model.loss(x, y).backward()
        opt.step()

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=15)
    a = p.parse_args(argv)
    if a.threads < 1 or a.reps < 1:
        p.error("--threads and --reps must be >= 1")
    torch.set_num_threads(a.threads)
    batch, seq = int(DEFAULTS["batch_size"]), int(DEFAULTS["seq_len"])
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch, seq), generator=g)
    y = torch.randint(0, 256, (batch, seq), generator=g)
    load0 = os.getloadavg()[0]
    fns = {r: step_fn(r, x, y) for r in ROUTERS}
    res = compare(fns, torch.device("cpu"), reps=a.reps, warmup=5)
    load1 = os.getloadavg()[0]
    top = res["topk"]["median_ms"]
    print(
        f"token-moe training step, batch {batch} x {seq} tokens, {a.threads} thread(s), "
        f"load {load0:.2f} -> {load1:.2f}, medians of {a.reps} interleaved rounds"
    )
    print(f"{'router':<22}{'ms/step':>10}{'tokens/s':>12}{'Top-k / router':>16}")
    for r, m in res.items():
        ms = m["median_ms"]
        print(f"{r:<22}{ms:>10.1f}{batch * seq / ms * 1000:>12.0f}{top / ms:>15.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
