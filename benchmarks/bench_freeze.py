"""``dselectk.export.freeze`` on the MovieLens architecture: parameters and inference time.

The model is ``experiments.movielens.build_model("dselect_k_static", k=2)`` with ML-1M sizes,
its static gates set binary (task 0 uses experts {1, 4}, task 1 uses {4, 6}: 3 of 8 experts).
Checks that the frozen model's outputs equal the eager model's (1e-6), then times both, best of
5 repetitions, in one process::

    python -m benchmarks.bench_freeze [--threads 2] [--batches 1 256 4096]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from dselectk.export import freeze
from dselectk.runtime import tune_allocator
from dselectk_research.movielens import build_model

ML1M = {"num_users": 6040, "num_items": 3706, "side": (7, 2, 21, 18)}


def _inputs(b: int) -> torch.Tensor:
    cols = [6040, 3706, 7, 2, 21]
    ids = [torch.randint(0, c, (b, 1)) for c in cols]
    return torch.cat([*ids, torch.randint(0, 2, (b, 18))], 1)


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _best_seconds(m: nn.Module, x: torch.Tensor) -> float:
    for _ in range(20):
        m(x)
    reps = max(20, 2000 // x.shape[0])
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            m(x)
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 256, 4096])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_allocator()
    torch.manual_seed(0)
    model = build_model("dselect_k_static", {"k": 2, "gamma": 1.0, "entropy_reg": 0.0}, ML1M)
    model.eval()
    gates = model.gates
    with torch.no_grad():  # converged: binary S(Z) on fixed codes
        codes = torch.tensor([[1, 4], [4, 6]])
        bits = (codes.unsqueeze(-1) >> torch.arange(gates.num_bits)) & 1
        gates.z.copy_((bits.float() * 2 - 1) * gates.gamma)
    assert bool(gates.is_binary().all())
    frozen = freeze(model)
    print(
        f"parameters: {_params(model):,} -> {_params(frozen):,} "
        f"(experts {model.mixer.num_experts} -> {frozen.mixer.num_experts})"
    )
    with torch.no_grad():
        for b in args.batches:
            x = _inputs(b)
            for a, c in zip(model(x).outputs, frozen(x).outputs, strict=True):
                assert float((a - c).abs().max()) <= 1e-6
            eager, fast = _best_seconds(model, x), _best_seconds(frozen, x)
            print(
                f"batch {b:5d}: eager {eager * 1e3:8.3f} ms, frozen {fast * 1e3:8.3f} ms, "
                f"eager/frozen {eager / fast:.2f} ({args.threads} threads)"
            )


if __name__ == "__main__":
    main()
