"""Step time of ``train`` on 1 vs 2 intra-op threads across work sizes (batch x parameters), in
one process, the two thread counts alternating (``TrainConfig.threads``: what "auto" picks).

    python scripts/measure_train_threads.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dselectk.gates import make_gate
from dselectk.layers import StackedMLP, make_towers
from dselectk.models import MultiGateMoE
from dselectk.training import TaskData, TrainConfig, train

#: (input features, expert hidden units, batch size): a 2-task MMoE with 8 experts
SIZES = [(16, 16, 32), (32, 64, 64), (64, 128, 128), (128, 256, 256), (256, 512, 512),
         (256, 1024, 1024)]  # fmt: skip


def step_ms(d: int, h: int, b: int, threads: int, steps: int = 12) -> float:
    torch.manual_seed(0)
    model = MultiGateMoE(
        StackedMLP(8, d, [h], final_activation=True),
        make_gate("softmax", 8, num_gates=2, in_features=d),
        make_towers(2, h, [1]),
    )
    x = torch.randn(b * steps, d)
    data = TaskData(x, [x[:, :1], x[:, 1:2]])
    cfg = TrainConfig(epochs=1, batch_size=b, progress=False, threads=threads, seed=None)
    t = time.perf_counter()
    train(model, data, "mse", cfg)
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"torch threads by default: {torch.get_num_threads()}")
    print("d h B | params | work=B*params | ms/step 1 thread | 2 threads | 2/1")
    for d, h, b in SIZES:
        torch.manual_seed(0)
        model = MultiGateMoE(
            StackedMLP(8, d, [h], final_activation=True),
            make_gate("softmax", 8, num_gates=2, in_features=d),
            make_towers(2, h, [1]),
        )
        params = sum(q.numel() for q in model.parameters())
        one, two = [], []
        step_ms(d, h, b, 1, 2)  # warm up
        for _ in range(args.rounds):
            one.append(step_ms(d, h, b, 1))
            two.append(step_ms(d, h, b, 2))
        m1, m2 = statistics.median(one), statistics.median(two)
        print(f"{d} {h} {b} | {params} | {b * params:.2e} | {m1:.2f} | {m2:.2f} | {m2 / m1:.2f}")


if __name__ == "__main__":
    main()
