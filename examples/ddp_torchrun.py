"""Distributed data-parallel training with torchrun (2 CPU processes, the gloo backend).

`train` accepts a model wrapped in DistributedDataParallel: each rank trains on an equal shard
of one shared shuffle, and the ranks' weights stay identical.

    torchrun --nproc-per-node 2 examples/ddp_torchrun.py
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dselectk import DSelectK, MultiGateMoE
from dselectk.layers import StackedMLP
from dselectk.training import TaskData, TrainConfig, train

dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank = dist.get_rank()
torch.set_num_threads(1)

torch.manual_seed(0)  # the same initial weights and the same data on every rank
model = MultiGateMoE(
    StackedMLP(4, 8, [16], final_activation=True),
    DSelectK(num_experts=4, k=2, num_gates=2, entropy_reg=0.01),
    StackedMLP(2, 16, [1], final_activation=False),
)
x = torch.randn(512, 8)
data = TaskData(x, [x[:, :2].sum(1, keepdim=True), x[:, 2:4].sum(1, keepdim=True)])

history = train(
    DistributedDataParallel(model),
    data,
    "mse",
    TrainConfig(lr=0.02, epochs=3, batch_size=32, progress=False),
)

# Every rank ends with the same weights: compare a checksum across ranks.
checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
sums = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
dist.all_gather(sums, checksum)
if rank == 0:
    loss = history.train_loss[-1]
    print(f"{dist.get_world_size()} ranks, {history.steps} steps each, train loss {loss:.4f}")
    print("weights identical on every rank:", all(torch.equal(s, sums[0]) for s in sums))
    assert all(torch.equal(s, sums[0]) for s in sums)
dist.destroy_process_group()
