"""MoE (Eq. 1), multi-gate MoE, shared bottom: math, banks vs lists, conditional computation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dselectk.gates import DSelectK, DSelectKExtended, SoftmaxGate, TopKGate
from dselectk.layers import ExpertList, StackedMLP
from dselectk.models import MoE, MultiGateMoE, SharedBottom

P = 6


def test_stacked_mlp_equals_separate_linears() -> None:
    torch.manual_seed(0)
    bank = StackedMLP(3, P, [5, 2], dropout=0.0, final_activation=False)
    x = torch.randn(4, P)
    out = bank(x)
    for e in range(3):
        h = torch.relu(x @ bank.weights[0][e] + bank.biases[0][e])
        ref = h @ bank.weights[1][e] + bank.biases[1][e]
        torch.testing.assert_close(out[e], ref)
    torch.testing.assert_close(bank(x, torch.tensor([2, 0])), out[[2, 0]])


def test_moe_is_weighted_sum_of_experts() -> None:
    experts = StackedMLP(4, P, [3], final_activation=True)
    gate = SoftmaxGate(4, in_features=P)
    moe = MoE(experts, gate)
    x = torch.randn(5, P)
    out = moe(x)
    g = gate(x).weights
    expected = (experts(x) * g.T.unsqueeze(-1)).sum(0)
    torch.testing.assert_close(out.output, expected)


def test_gate_bank_equals_list_of_gates() -> None:
    torch.manual_seed(0)
    experts = StackedMLP(8, P, [4], final_activation=True)
    bank = DSelectK(8, 2, num_gates=3, gamma=2.0, entropy_reg=0.1)
    singles = [DSelectK(8, 2, gamma=2.0, entropy_reg=0.1) for _ in range(3)]
    with torch.no_grad():
        for t, g in enumerate(singles):
            g.logits.copy_(bank.logits[t])
    towers = StackedMLP(3, 4, [1], activation="identity")
    m1 = MultiGateMoE(experts, bank, towers)
    m2 = MultiGateMoE(experts, singles, towers)
    x = torch.randn(7, P)
    o1, o2 = m1(x), m2(x)
    for a, b in zip(o1.outputs, o2.outputs):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(o1.aux_loss, o2.aux_loss)
    torch.testing.assert_close(o1.gate_weights, o2.gate_weights)


def test_mixed_static_and_per_example_gates() -> None:
    experts = StackedMLP(4, P, [3], final_activation=True)
    gates = [TopKGate(4, 2, in_features=P), DSelectK(4, 2)]
    towers = [nn.Linear(3, 1), nn.Linear(3, 2)]
    model = MultiGateMoE(experts, gates, towers)
    x = torch.randn(5, P)
    out = model(x)
    assert [o.shape for o in out.outputs] == [(5, 1), (5, 2)]
    assert out.gate_weights is not None and out.gate_weights.shape == (5, 2, 4)
    mixed_1 = (experts(x) * gates[1]().weights.view(4, 1, 1)).sum(0)
    torch.testing.assert_close(out.outputs[1], towers[1](mixed_1))


def _binary_bank() -> DSelectK:
    gate = DSelectK(8, 2, num_gates=2, gamma=1.0)
    with torch.no_grad():
        # task 0 -> experts 1, 2; task 1 -> experts 2, 6: experts 0, 3, 4, 5, 7 unused
        codes = torch.tensor([[1, 2], [2, 6]])
        bits = (codes.unsqueeze(-1) >> torch.arange(3)) & 1
        gate.logits[..., 2:] = ((bits * 2 - 1) * 1.0).flatten(-2).float()
    return gate


def test_conditional_computation_is_exact() -> None:
    torch.manual_seed(0)
    experts = StackedMLP(8, P, [4], final_activation=True)
    towers = StackedMLP(2, 4, [1], activation="identity")
    gate = _binary_bank()
    sparse = MultiGateMoE(experts, gate, towers, conditional=True)
    dense = MultiGateMoE(experts, gate, towers, conditional=False)
    x = torch.randn(9, P)
    outs = []
    for model in (sparse, dense):
        model.zero_grad()
        out = model(x)
        sum(o.sum() for o in out.outputs).backward()
        outs.append(
            ([o.detach() for o in out.outputs], [p.grad.clone() for p in model.parameters()])
        )
    for a, b in zip(outs[0][0], outs[1][0]):
        torch.testing.assert_close(a, b)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b)


def test_conditional_computation_skips_unused_experts() -> None:
    calls: list[int] = []

    class Counting(nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.i = i
            self.lin = nn.Linear(P, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(self.i)
            return self.lin(x)

    experts = ExpertList([Counting(i) for i in range(8)])
    model = MultiGateMoE(experts, _binary_bank())
    model(torch.randn(3, P))
    assert sorted(calls) == [1, 2, 6]


def test_shared_bottom() -> None:
    shared = nn.Sequential(nn.Linear(P, 8), nn.ReLU())
    model = SharedBottom(shared, StackedMLP(3, 8, [2], final_activation=True))
    out = model(torch.randn(4, P))
    assert len(out.outputs) == 3 and out.outputs[0].shape == (4, 2)
    assert out.gate_weights is None and out.aux_loss.item() == 0.0


def test_bottom_module_feeds_experts_and_gates() -> None:
    bottom = nn.Embedding(10, P)
    model = MultiGateMoE(
        StackedMLP(4, P, [3], final_activation=True),
        TopKGate(4, 2, in_features=P, num_gates=2),
        bottom=bottom,
    )
    out = model(torch.tensor([1, 2, 3]))
    assert out.outputs[0].shape == (3, 3)


def test_model_argument_errors() -> None:
    experts = StackedMLP(4, P, [3], final_activation=True)
    with pytest.raises(ValueError, match="num_experts=8"):
        MultiGateMoE(experts, DSelectK(8, 2, num_gates=2))
    with pytest.raises(ValueError, match="num_gates=T"):
        MultiGateMoE(experts, DSelectK(4, 2))
    with pytest.raises(ValueError, match="towers must hold 2"):
        MultiGateMoE(experts, DSelectK(4, 2, num_gates=2), [nn.Linear(3, 1)])
    with pytest.raises(ValueError, match="one member per task"):
        MultiGateMoE(
            experts, DSelectK(4, 2, num_gates=2), StackedMLP(3, 3, [1], final_activation=True)
        )
    with pytest.raises(TypeError, match="gates\\[1\\]"):
        MultiGateMoE(experts, [DSelectK(4, 2), nn.Linear(2, 2)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="single gate"):
        MoE(experts, DSelectK(4, 2, num_gates=2))
    with pytest.raises(TypeError, match="expert bank"):
        MoE(nn.Linear(3, 3), DSelectK(4, 2))
    with pytest.raises(ValueError, match="dropout"):
        StackedMLP(2, 3, [4], dropout=1.0, final_activation=True)
    with pytest.raises(ValueError, match="features"):
        experts(torch.randn(2, P + 1))


@pytest.mark.slow
def test_compiled_per_example_gate_and_mmoe_step() -> None:
    torch.manual_seed(0)
    gate = DSelectK(16, 4, in_features=P, entropy_reg=0.1)
    x = torch.randn(32, P)
    compiled = torch.compile(gate)
    torch.testing.assert_close(compiled(x).weights, gate(x).weights)
    gate.gamma = 0.5  # a schedule changes a buffer in place: still correct
    torch.testing.assert_close(compiled(x).weights, gate(x).weights)

    model = MultiGateMoE(
        StackedMLP(8, P, [16], final_activation=True),
        DSelectK(8, 2, num_gates=2),
        StackedMLP(2, 16, [1], final_activation=True),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(xb: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(xb)
        loss = sum(((o.squeeze(-1) - y) ** 2).mean() for o in out.outputs) + out.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    cstep = torch.compile(step)
    y = torch.randn(32)
    losses = [float(cstep(x, y)) for _ in range(5)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("tasks", [1, 3])
def test_padded_and_per_expert_routing_equal_dense(tasks: int) -> None:
    """Both routing paths (padded batched call: accelerators; per-expert calls: CPU) are exact."""
    torch.manual_seed(0)
    gate = DSelectKExtended(8, 2, in_features=P, num_gates=tasks, init="spread")
    with torch.no_grad():
        gate.proj.weight.mul_(1e3)  # binary bits: each example uses <= 2 experts per task
    experts = StackedMLP(8, P, [5], final_activation=True)
    routed = MultiGateMoE(experts, gate).eval()
    dense = MultiGateMoE(experts, gate, conditional=False).eval()
    x = torch.randn(64, P)
    with torch.no_grad():
        w = gate(x).weights.view(64, tasks, 8)
        used = (w != 0).any(1)
        counts = used.sum(0)
        per_expert = counts.tolist()
        active = [i for i, c in enumerate(per_expert) if c > 0]
        padded = routed.mixer._dispatch_padded(
            x, w, used.t().nonzero(), counts, active, max(per_expert)
        )
        expected = torch.stack(dense(x).outputs)
        torch.testing.assert_close(padded, expected)
        torch.testing.assert_close(torch.stack(routed(x).outputs), expected)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("sizes", [[5], [2, 7, 3], [9, 4]])
def test_stacked_mlp_forward_grouped_equals_member_forward(grad: bool, sizes: list[int]) -> None:
    """Grouped rows (routing) give each member's own outputs, values and gradients alike."""
    torch.manual_seed(0)
    bank = StackedMLP(4, P, sizes, final_activation=False)
    counts = [3, 0, 5, 1]
    x = torch.randn(sum(counts), P)
    member = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    ref = torch.stack([bank(x[i : i + 1], member[i : i + 1])[0, 0] for i in range(len(x))])
    with torch.set_grad_enabled(grad):
        out = bank.forward_grouped(x, counts)
    torch.testing.assert_close(out, ref.detach())
    assert out.requires_grad is grad
    if grad:
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, list(bank.parameters()), g)
        want = torch.autograd.grad(ref, list(bank.parameters()), g)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="counts must have 4 entries"):
        bank.forward_grouped(x, counts[:3])
    with pytest.raises(ValueError, match="sum\\(counts\\)"):
        bank.forward_grouped(x[:-1], counts)


@pytest.mark.parametrize("grad", [False, True])
def test_stacked_mlp_forward_grouped_with_no_rows(grad: bool) -> None:
    """No row routed to any member (e.g. an empty batch of tokens): an empty output, and under
    autograd zero gradients instead of torch.cat on an empty list."""
    bank = StackedMLP(3, P, [5, 2], final_activation=True)
    with torch.set_grad_enabled(grad):
        out = bank.forward_grouped(torch.zeros(0, P), [0, 0, 0])
    assert out.shape == (0, 2)
    if grad:
        grads = torch.autograd.grad(out.sum(), list(bank.parameters()))
        assert all(bool((g == 0).all()) for g in grads)
