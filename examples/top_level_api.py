"""Every top-level name of ``dselectk`` in one short run (CI runs this file).

A 3-task multi-gate MoE trained with the recommended call (``train`` with its defaults: the swap
search makes each task's k = 2 DSelect-k gate end on 2 distinct experts), then the other gates,
a single-gate MoE with an explicit SwapSearch callback, a bank of restarts and a per-token layer.
"""

import torch

from dselectk import (
    COMETGate,
    DSelectK,
    GumbelSoftmaxGate,
    MoE,
    MoEBank,
    MultiGateMoE,
    SoftmaxGate,
    SparseMoEFeedForward,
    SwapSearch,
    TaskData,
    TopKGate,
    TrainConfig,
    make_gate,
    train,
)
from dselectk.layers import StackedMLP, make_towers

torch.manual_seed(0)
x = torch.randn(1024, 6)
data = TaskData(x, [x[:, :1] - 2 * x[:, 1:2], torch.sin(x[:, 2:3]) - 1.5, x[:, 3:4] * x[:, 4:5]])
config = TrainConfig(epochs=3, batch_size=64, progress=False)

# 1. The recommended call: 8 experts, one k = 2 DSelect-k gate per task, linear-output towers.
gates = DSelectK(num_experts=8, k=2, num_gates=3)
model = MultiGateMoE(
    StackedMLP(8, 6, [16], final_activation=True), gates, make_towers(3, 16, [8, 1])
)
history = train(model, data, "mse", config)
print("selected experts per task:", gates.selection().tolist())
assert all(len(set(row)) == 2 for row in gates.selection().tolist())

# 2. The other gates, by class or by registry name (static here; in_features=p: per-example).
for gate in (
    TopKGate(8, k=2, num_gates=3),
    SoftmaxGate(8, num_gates=3),
    COMETGate(8, k=2, num_gates=3),
    GumbelSoftmaxGate(8, num_gates=3),
    make_gate("dselect_k", 8, k=2, num_gates=3),
):
    out = MultiGateMoE(
        StackedMLP(8, 6, [16], final_activation=True), gate, make_towers(3, 16, [8, 1])
    )(x[:4])
    print(type(gate).__name__, [tuple(o.shape) for o in out.outputs])

# 3. A single-gate MoE with an explicit search schedule (SwapSearch as a callback).
moe = MoE(StackedMLP(8, 6, [8, 1], final_activation=False), DSelectK(8, k=2))
probe = TaskData(x[:256], [data.ys[0][:256]])


def probe_loss() -> torch.Tensor:
    return (moe(probe.x).output - probe.ys[0]).pow(2).mean()


search = SwapSearch(moe.gate, probe_loss, at=[8], binarize_at=[16])
one_task = TaskData(x, [data.ys[0]])
train(moe, one_task, "mse", TrainConfig(epochs=1, batch_size=64, progress=False, search=None),
      callbacks=[search])  # fmt: skip
print("MoE selection:", moe.gate.selection().tolist(), "moves:", search.total_moves.tolist())

# 4. R = 2 restarts of a 3-task MMoE (scalar experts, no towers) trained as one batched model.
bank = MoEBank(StackedMLP(2 * 8, 6, [4, 1], final_activation=False), DSelectK(8, 2, num_gates=6), 2)
train(bank, data, "mse", config)
print("bank selections:", bank.gates.selection().shape)

# 5. A per-token sparse MoE feed-forward block (a transformer's FFN).
ffn = SparseMoEFeedForward(d_model=16, d_ff=32, num_experts=4, k=2)
print("per-token layer:", tuple(ffn(torch.randn(2, 5, 16)).output.shape))
