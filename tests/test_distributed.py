"""Training under PyTorch's DistributedDataParallel (2 CPU processes, gloo backend)."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from dselectk.gates import DSelectK
from dselectk.layers import StackedMLP
from dselectk.models import MultiGateMoE
from dselectk.training import TaskData, TrainConfig, train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model() -> MultiGateMoE:
    torch.manual_seed(0)
    return MultiGateMoE(
        StackedMLP(4, 3, [8], final_activation=True),
        DSelectK(4, 2, num_gates=2, entropy_reg=0.01),
        StackedMLP(2, 8, [1], activation="identity"),
    )


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model()  # identical initial weights on every rank
        g = torch.Generator().manual_seed(1)
        x = torch.randn(200, 3, generator=g)
        data = TaskData(x, [x[:, :1] * 2, x[:, 1:2] - x[:, 2:]])
        ddp = DistributedDataParallel(model)
        cfg = TrainConfig(lr=0.05, epochs=3, batch_size=20, progress=False, seed=0)
        hist = train(ddp, data, "mse", cfg)
        torch.save(
            {"state": model.state_dict(), "steps": hist.steps}, Path(out_dir) / f"rank{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_ddp_training_keeps_ranks_in_sync() -> None:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, _free_port(), d), nprocs=2, join=True)
        r0 = torch.load(Path(d) / "rank0.pt")
        r1 = torch.load(Path(d) / "rank1.pt")
    assert r0["steps"] == r1["steps"] == 3 * 5  # 100 examples per rank, batches of 20
    for key, value in r0["state"].items():
        torch.testing.assert_close(value, r1["state"][key], rtol=0, atol=0)
    initial = _model().state_dict()
    assert not torch.equal(r0["state"]["gates.logits"], initial["gates.logits"])
