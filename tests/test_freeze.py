"""freeze: a converged model keeps only the experts its static gates use, outputs unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from dselectk import DSelectK, MoE, MultiGateMoE
from dselectk.export import FixedGate, SelectedExperts, export_program, freeze, to_onnx
from dselectk.gates import (
    DSelectKExtended,
    GumbelSoftmaxGate,
    SoftmaxGate,
    SoftmaxSelectorGate,
    TopKGate,
)
from dselectk.layers import ExpertList, StackedMLP

N, P = 8, 6


def _binary_static(codes: list[list[int]], bank: bool = True) -> DSelectK:
    """A static bank (one gate per row of ``codes``; one gate if not ``bank``), S(Z) binary."""
    c = torch.tensor(codes)
    gate = DSelectK(N, c.shape[1], num_gates=c.shape[0] if bank else None)
    if not bank:
        c = c[0]
    with torch.no_grad():
        bits = (c.unsqueeze(-1) >> torch.arange(gate.num_bits)) & 1
        gate.z.copy_((bits.float() * 2 - 1) * gate.gamma)
        gate.alpha.normal_()
    assert bool(gate.is_binary().all())
    return gate


def _mtl(gates: object, experts: nn.Module | None = None) -> MultiGateMoE:
    torch.manual_seed(1)
    experts = experts if experts is not None else StackedMLP(N, P, [5], final_activation=True)
    towers = StackedMLP(2, 5, [4, 1], final_activation=False)
    return MultiGateMoE(experts, gates, towers)  # type: ignore[arg-type]


def _outputs(model: nn.Module, x: Tensor) -> list[Tensor]:
    with torch.no_grad():
        out = model.eval()(x)
    return [out.output] if hasattr(out, "output") else list(out.outputs)


def _assert_same(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    gen = torch.Generator().manual_seed(7)
    for batch in (64, 7, 1):
        x = torch.randn(batch, P, generator=gen)
        for got, want in zip(_outputs(a, x), _outputs(b, x), strict=True):
            torch.testing.assert_close(got, want, atol=atol, rtol=0)


def _num_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_frozen_bank_keeps_the_used_experts_only() -> None:
    model = _mtl(_binary_static([[1, 2], [2, 5]]))
    frozen = freeze(model)
    assert isinstance(frozen.gates, FixedGate)
    assert frozen.mixer.num_experts == 3 and frozen.mixer.experts.num_members == 3
    assert not frozen.mixer.conditional  # every kept expert is used: nothing to check per call
    per_expert = 6 * 5 + 5
    assert _num_params(frozen) == _num_params(model) - 5 * per_expert - model.gates.logits.numel()
    _assert_same(frozen, model)
    assert model.mixer.num_experts == N and isinstance(model.gates, DSelectK)  # not modified
    assert frozen.gates.fixed_weights.shape == (2, 3)


def test_frozen_list_of_gates_and_single_gate_moe() -> None:
    single = [_binary_static([[0, 3]], bank=False), _binary_static([[3, 6]], bank=False)]
    model = _mtl(single)
    frozen = freeze(model)
    assert frozen.mixer.num_experts == 3
    assert all(isinstance(g, FixedGate) for g in frozen.gates)
    _assert_same(frozen, model)
    torch.manual_seed(0)
    moe = MoE(StackedMLP(N, P, [5], final_activation=True), single[0])
    frozen_moe = freeze(moe)
    assert frozen_moe.mixer.num_experts == 2
    _assert_same(frozen_moe, moe)


def test_single_expert_left() -> None:
    gate = DSelectK(N, 1)
    with torch.no_grad():
        gate.z.copy_(torch.tensor([[1.0, -1.0, 1.0]]) * gate.gamma)  # expert 5
    moe = MoE(StackedMLP(N, P, [5], final_activation=True), gate)
    frozen = freeze(moe)
    assert frozen.mixer.num_experts == 1
    _assert_same(frozen, moe)


def test_not_converged_is_refused_unless_forced() -> None:
    model = _mtl(DSelectK(N, 2, num_gates=2))  # S(Z) starts inside (0, 1)
    with pytest.raises(ValueError, match="not binary"):
        freeze(model)
    frozen = freeze(model, force=True)
    assert frozen.mixer.num_experts == N  # every expert has weight: none removed
    _assert_same(frozen, model)
    dense = _mtl(SoftmaxGate(N, num_gates=2))
    with pytest.raises(ValueError, match="dense gate"):
        freeze(dense)
    _assert_same(freeze(dense, force=True), dense)


def test_static_topk_and_gumbel_are_always_freezable() -> None:
    torch.manual_seed(0)
    topk = _mtl(TopKGate(N, 2, num_gates=2))
    frozen = freeze(topk)
    assert frozen.mixer.num_experts <= 4
    _assert_same(frozen, topk)
    gumbel = GumbelSoftmaxGate(N, num_gates=2)
    with torch.no_grad():
        gumbel.logits[..., N:] = torch.tensor([1.0, -1, -1, 2, -1, -1, -1, -1])
    model = _mtl(gumbel).train()
    frozen = freeze(model)
    assert frozen.mixer.num_experts == 2 and model.training  # eval-mode weights; model untouched
    _assert_same(frozen, model)


def test_ablation_gate_needs_k_sparse_weights() -> None:
    gate = SoftmaxSelectorGate(N, 2, num_gates=2)
    with pytest.raises(ValueError, match="more than k=2"):
        freeze(_mtl(gate))
    with torch.no_grad():
        gate.logits[..., 2:] = -1e4
        gate.logits.view(2, -1)[:, [2 + 1, 2 + N + 4]] = 1e4  # selectors one-hot on 1 and 4
    model = _mtl(gate)
    frozen = freeze(model)
    assert frozen.mixer.num_experts == 2
    _assert_same(frozen, model)


def test_per_example_gates_keep_routing_exactly() -> None:
    torch.manual_seed(0)
    per_example = DSelectKExtended(N, 2, in_features=P, init="spread")
    with torch.no_grad():
        per_example.proj.weight.mul_(1e4)
    model = _mtl([_binary_static([[1, 2]], bank=False), per_example])
    frozen = freeze(model)
    assert isinstance(frozen.gates[0], FixedGate) and isinstance(frozen.gates[1], DSelectK)
    assert frozen.mixer.num_experts == N and frozen.mixer.conditional  # routing kept
    x = torch.randn(50, P)
    w = frozen.gate_weights(x)[0]
    assert frozen.mixer.dispatch(x, w) is not None
    for got, want in zip(_outputs(frozen, x), _outputs(model, x)):
        assert torch.equal(got, want)  # the same computation, bit for bit


def test_expert_list_and_other_banks() -> None:
    torch.manual_seed(0)
    experts = ExpertList([nn.Sequential(nn.Linear(P, 5), nn.Tanh()) for _ in range(N)])
    model = _mtl(_binary_static([[1, 2], [2, 5]]), experts)
    frozen = freeze(model)
    assert isinstance(frozen.mixer.experts, ExpertList) and frozen.mixer.num_experts == 3
    _assert_same(frozen, model)

    class Bank(nn.Module):  # a bank freeze cannot slice: wrapped as a static gather
        def __init__(self) -> None:
            super().__init__()
            self.inner = StackedMLP(N, P, [5], final_activation=True)
            self.num_members = N

        def forward(self, x: Tensor, members: Tensor | None = None) -> Tensor:
            return self.inner(x, members)

    model = _mtl(_binary_static([[1, 2], [2, 5]]), Bank())
    frozen = freeze(model)
    assert isinstance(frozen.mixer.experts, SelectedExperts)
    _assert_same(frozen, model)


def test_frozen_model_exports(tmp_path: Path) -> None:
    model = _mtl(_binary_static([[1, 2], [2, 5]]))
    frozen = freeze(model)
    export_program(frozen, torch.randn(16, P))
    if pytest.importorskip("onnxruntime"):
        to_onnx(frozen, torch.randn(16, P), tmp_path / "f.onnx", exporter="torchscript")


def test_freeze_rejects_other_models() -> None:
    with pytest.raises(TypeError, match="MoE"):
        freeze(nn.Linear(2, 2))
