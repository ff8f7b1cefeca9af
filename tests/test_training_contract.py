"""The contract of ``train``: it trains every model family the library builds (each public
layer or model that is a whole model), and ``evaluate`` reads the same outputs."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from dselectk import layers, models
from dselectk.gates import make_gate
from dselectk.layers import SparseMoEFeedForward, StackedMLP, make_towers
from dselectk.models import MoE, MoEBank, MultiGateMoE, SharedBottom
from dselectk.training import TaskData, TrainConfig, evaluate, train


def _inputs(n: int = 96, d: int = 4) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(3))


def _moe() -> tuple[nn.Module, TaskData]:
    x = _inputs()
    gate = make_gate("softmax", 4, in_features=4)  # per-example
    return MoE(StackedMLP(4, 4, [8, 1], final_activation=False), gate), TaskData(
        x, [x[:, :1] - 2 * x[:, 1:2]]
    )


def _mmoe() -> tuple[nn.Module, TaskData]:
    x = _inputs()
    gates = make_gate("dselect_k", 4, k=2, num_gates=2)
    model = MultiGateMoE(
        StackedMLP(4, 4, [8], final_activation=True), gates, make_towers(2, 8, [1])
    )
    return model, TaskData(x, [x[:, :1] * 2, (x[:, 1:2] > 0).float()])


def _shared_bottom() -> tuple[nn.Module, TaskData]:
    x = _inputs()
    model = SharedBottom(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), make_towers(2, 8, [1]))
    return model, TaskData(x, [x[:, :1] * 2, x[:, 2:3] - x[:, 3:4]])


def _bank() -> tuple[nn.Module, TaskData]:
    x = _inputs()
    members, tasks, experts = 3, 2, 4
    bank = MoEBank(
        StackedMLP(members * experts, 4, [5], final_activation=True),
        make_gate("softmax", experts, num_gates=members * tasks),
        members=members,
    )
    return bank, TaskData(x, [x[:, 0] * 0.5 + 1, x[:, 1:2].abs()])


def _token_moe() -> tuple[nn.Module, TaskData]:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(48, 5, 8, generator=g)  # (N, S, d_model)
    ffn = SparseMoEFeedForward(8, 16, 4, "topk", k=2)
    return ffn, TaskData(x, [torch.tanh(x.flip(-1))])


#: every public layer or model of the library that is a whole model -> (model, data) and losses
FAMILIES: dict[str, tuple[Callable[[], tuple[nn.Module, TaskData]], object]] = {
    "MoE": (_moe, "mse"),
    "MultiGateMoE": (_mmoe, ["mse", "bce"]),
    "SharedBottom": (_shared_bottom, "mse"),
    "MoEBank": (_bank, "mse"),
    "SparseMoEFeedForward": (_token_moe, "mse"),
}

#: public modules that are parts of a model, not models: why ``train`` does not take them alone
PARTS = {
    "StackedMLP": "an expert bank: (E, B, out), members first, one output per expert",
    "ExpertList": "an expert bank: (E, B, out), members first, one output per expert",
    "GatedMLP": "a SwiGLU expert bank of the per-token layer: (E, B, out), like StackedMLP",
    "ExpertMixer": "combines an expert bank with weights a gate gives it; has no gate itself",
}


def test_every_public_module_is_covered() -> None:
    public = {
        name
        for mod in (layers, models)
        for name in mod.__all__
        if isinstance(getattr(mod, name), type) and issubclass(getattr(mod, name), nn.Module)
    }
    assert public == set(FAMILIES) | set(PARTS)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_train_and_evaluate_take_every_model_family(family: str) -> None:
    build, losses = FAMILIES[family]
    torch.manual_seed(0)
    model, data = build()
    before = evaluate(model, data, losses)["loss"]
    cfg = TrainConfig(epochs=8, batch_size=32, lr=1e-2, progress=False)
    hist = train(model, data, losses, cfg, val_data=data)
    after = evaluate(model, data, losses)["loss"]
    assert len(hist.train_loss) == 8 and not hist.diverged
    assert all(math.isfinite(v) for v in hist.train_loss)
    assert hist.val_losses[-1] == pytest.approx(after)
    assert sum(after) < 0.9 * sum(before), (before, after)


def test_a_bank_trains_as_its_own_loss_says() -> None:
    """``train(bank, data, "mse")`` follows the trajectory of the bank's own loss: each task's
    loss sums the members' MSE, plus the gates' auxiliary loss (MoEBank.loss)."""
    torch.manual_seed(0)
    bank, data = _bank()
    twin = copy.deepcopy(bank)
    cfg = TrainConfig(epochs=3, batch_size=32, lr=1e-2, progress=False)
    train(bank, data, "mse", cfg)

    def own_loss(model: nn.Module, batch: TaskData) -> tuple[torch.Tensor, None]:
        y = torch.stack([t.reshape(-1) for t in batch.ys], 1)
        return model.loss(batch.x, y, fused=False), None

    train(twin, data, None, cfg, loss_fn=own_loss)
    for (name, a), b in zip(bank.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # evaluate: a task's loss is the members' mean MSE
    with torch.no_grad():
        pred, _ = bank(data.x)  # (R, T, B)
    for t, got in enumerate(evaluate(bank, data, "mse")["loss"]):
        want = (pred[:, t, :] - data.ys[t].reshape(1, -1)).square().mean()
        assert got == pytest.approx(float(want), rel=1e-5)


def test_a_model_with_an_unreadable_output_is_a_clear_error() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": self.lin(x)}

    x = _inputs()
    with pytest.raises(TypeError, match=r"returned dict.*pass loss_fn"):
        train(Pair(), TaskData(x, [x[:, :1]]), "mse", TrainConfig(epochs=1, progress=False))
