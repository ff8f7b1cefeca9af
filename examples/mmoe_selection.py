"""Multi-gate MoE on your own data, with DSelect-k gates that select experts per task.

Two tasks share 8 experts; each task's static DSelect-k gate learns which 2 it uses. The swap
search that ``train`` runs by default moves selectors that settled on a poor or already-held
expert and, half-way through, makes every selection final (binary, exactly k distinct experts).

    python examples/mmoe_selection.py
"""

import torch

from dselectk import DSelectK, MultiGateMoE
from dselectk.layers import StackedMLP
from dselectk.training import TaskData, TrainConfig, train

torch.manual_seed(0)

# Your data: inputs shared by every task, one target column per task (first dim: examples).
x = torch.randn(1024, 16)
y_a = x[:, :4].sum(1, keepdim=True)  # task A depends on features 0-3
y_b = x[:, :4].sum(1, keepdim=True) - x[:, 4:8].sum(1, keepdim=True)  # task B on 0-7
data = TaskData(x, [y_a, y_b])
train_data, val_data = data.batch(torch.arange(0, 896)), data.batch(torch.arange(896, 1024))

model = MultiGateMoE(
    # 8 experts, each 16 -> 32 and ReLU, evaluated as one batched matmul
    StackedMLP(8, 16, [32], final_activation=True),
    DSelectK(num_experts=8, k=2, num_gates=2, gamma=10.0, entropy_reg=0.1),  # one gate per task
    StackedMLP(2, 32, [16, 1], final_activation=False),  # one tower per task
)

# train() runs the swap search by default (TrainConfig(search="auto")): after 25 % of the steps,
# at 50 % (every selection made final: binary, k distinct experts), 70 % and 85 %, each move
# scored by the task's loss on a fixed probe of the training data. search=None turns it off.
config = TrainConfig(lr=0.02, batch_size=64, epochs=15, progress=False)
history = train(model, train_data, "mse", config, val_data=val_data)

weights = model.gates.expert_weights()  # (tasks, experts)
for t in range(2):
    chosen = weights[t].nonzero().flatten().tolist()
    print(f"task {t}: experts {chosen}, weights {[round(float(weights[t, i]), 2) for i in chosen]}")
print("every selection final (S(Z) binary):", bool(model.gates.is_binary().all()))
print(
    f"validation MSE per task after {history.steps} steps:",
    [round(v, 4) for v in history.val_losses[-1]],
)
assert bool(model.gates.is_binary().all()) and ((weights > 0).sum(1) == 2).all()
