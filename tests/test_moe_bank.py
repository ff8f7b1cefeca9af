"""MoEBank (R independent multi-gate MoEs with static gates as one model), its fused loss, and
the ramps of a bank whose members train with their own hyperparameters."""

from __future__ import annotations

import pytest
import torch

from dselectk.gates import make_gate
from dselectk.layers import StackedMLP
from dselectk.models import MoEBank, bank
from dselectk.schedules import GeometricSchedule
from dselectk.variants import Ramp, Variant, stack_members

E, T, P, U = 4, 3, 5, 2


def _members(seeds: list[int], gate: str = "dselect_k", layers: list[int] | None = None) -> tuple:
    experts, gates = [], []
    for s in seeds:
        torch.manual_seed(s)
        experts.append(StackedMLP(E, P, layers or [U], final_activation=True))
        gates.append(make_gate(gate, E, k=2, num_gates=T))
    return experts, gates


def _bank(seeds: list[int], gate: str = "dselect_k", layers: list[int] | None = None) -> MoEBank:
    experts, gates = _members(seeds, gate, layers)
    r = len(seeds)
    return MoEBank(
        stack_members(StackedMLP(r * E, P, layers or [U], final_activation=True), experts),
        stack_members(make_gate(gate, E, k=2, num_gates=r * T), gates),
        members=r,
    )


def _composed(experts: StackedMLP, gate: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(T, B) predictions of one multi-gate MoE, written out: Σ_e w[t, e] Σ_u f_e(x)_u."""
    f = experts(x).sum(-1)  # (E, B)
    return gate().weights @ f


def test_a_member_of_the_bank_predicts_what_it_predicts_alone() -> None:
    seeds = [3, 4, 5]
    m = _bank(seeds)
    x = torch.randn(7, P)
    pred, aux = m(x)
    assert pred.shape == (3, T, 7)
    assert (m.members, m.num_tasks, m.num_experts) == (3, T, E)
    experts, gates = _members(seeds)
    for r in range(3):
        torch.testing.assert_close(pred[r], _composed(experts[r], gates[r], x))
    assert aux.item() == pytest.approx(sum(g().aux_loss.item() for g in gates), rel=1e-5)
    alone = _bank([4])  # a bank of one member gives member 1's predictions
    torch.testing.assert_close(alone(x)[0][0], pred[1])


def test_weights_and_mse() -> None:
    m = _bank([1, 2])
    x, y = torch.randn(10, P), torch.randn(10, T)
    w = m.inference_weights()
    assert w.shape == (2, T, E) and m.expert_weights().shape == (2, T, E)
    pred, _ = m(x, w)
    want = ((pred - y.T.unsqueeze(0)) ** 2).mean((1, 2)).double()
    torch.testing.assert_close(m.mse(x, y, w, chunk=3), want)  # chunked = in one go


@pytest.mark.parametrize("gate", ["dselect_k", "topk", "ablation_entropy"])
def test_fused_loss_equals_the_composed_loss(gate: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bank, "LOSS_BLOCK_WEIGHTS", T * E * 2)  # blocks of 2 members: 2, 2, 1
    x, y = torch.randn(16, P), torch.randn(16, T)
    out = []
    for fused in (True, False):
        m = _bank([7, 8, 9, 10, 11], gate)
        assert m.fusable
        loss = m.loss(x, y, fused=fused)
        loss.backward()
        out.append((loss.item(), [p.grad.clone() for p in m.parameters()]))
    (fast, g_fast), (ref, g_ref) = out
    assert fast == pytest.approx(ref, rel=1e-5)
    assert m.loss(x, y).item() == pytest.approx(ref, rel=1e-5)  # default: fused when fusable
    for a, b in zip(g_fast, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_fused_loss_gradcheck_float64() -> None:
    torch.manual_seed(0)
    reps, e, t, u, p, n = 2, 3, 4, 2, 5, 7
    x = torch.randn(n, p, dtype=torch.float64)
    w = torch.randn(reps * e, p, u, dtype=torch.float64, requires_grad=True)
    b = torch.randn(reps * e, u, dtype=torch.float64, requires_grad=True)
    gw = torch.rand(reps, t, e, dtype=torch.float64, requires_grad=True)
    y = torch.randn(n, t, dtype=torch.float64)
    for block in (1, 2):  # one block per repetition, and both in one block
        assert torch.autograd.gradcheck(
            lambda *a, block=block: bank._MixtureSSE.apply(x, *a, y, block), (w, b, gw)
        )


def test_deeper_experts_take_the_composed_loss() -> None:
    m = _bank([1, 2], layers=[3, 2])
    assert not m.fusable
    x, y = torch.randn(6, P), torch.randn(6, T)
    pred, aux = m(x)
    want = (pred - y.T.unsqueeze(0)).square().mean(-1).sum() + aux
    assert m.loss(x, y).item() == pytest.approx(want.item())
    with pytest.raises(ValueError, match="one-layer ReLU"):
        m.loss(x, y, fused=True)


def test_bad_banks_are_refused() -> None:
    gates = make_gate("dselect_k", E, k=2, num_gates=2 * T)
    with pytest.raises(ValueError, match="multiple of members"):
        MoEBank(StackedMLP(2 * E + 1, P, [U], final_activation=True), gates, members=2)
    with pytest.raises(ValueError, match="static gates"):
        MoEBank(
            StackedMLP(2 * E, P, [U], final_activation=True),
            make_gate("dselect_k", E, k=2),
            members=2,
        )
    with pytest.raises(ValueError, match="choose among"):
        MoEBank(StackedMLP(4 * E, P, [U], final_activation=True), gates, members=2)
    with pytest.raises(ValueError, match="members must be"):
        MoEBank(StackedMLP(E, P, [U], final_activation=True), gates, members=0)


def test_member_schedulers_start_at_each_members_value_and_span_its_epochs() -> None:
    v = Variant(
        "anneal",
        "ablation_annealing",
        "annealed",
        schedules=(Ramp("temperature", end=1e-6, shape="geometric"),),
    )
    members = [{"temperature": 1.0, "epochs": 2}, {"temperature": 0.5, "epochs": 4}]
    gate = v.build(E, k=2, num_gates=2 * T)
    (s,) = v.member_schedulers(gate, members, gates_per_member=T, steps_per_epoch=10)
    assert isinstance(s.schedule, GeometricSchedule)
    start = torch.tensor([1.0] * T + [0.5] * T, dtype=torch.float64)
    torch.testing.assert_close(s.schedule(0), start)
    end = s.schedule(40)  # member 0 ended at step 20, member 1 at step 40
    torch.testing.assert_close(end, torch.full((2 * T,), 1e-6, dtype=torch.float64))
    mid = s.schedule(20)
    assert float(mid[0]) == pytest.approx(1e-6) and float(mid[T]) > 1e-6
    # a ramp with a delay spans the whole run: the members must run the same epochs
    delayed = Variant(
        "warm", "dselect_k", "w", schedules=(Ramp("entropy_reg", end=0.5, delay=0.5),)
    )
    with pytest.raises(ValueError, match="different epochs"):
        delayed.member_schedulers(gate, members, T, 10)
    same = [{**m, "epochs": 3, "entropy_reg": 0.1} for m in members]
    (s,) = delayed.member_schedulers(delayed.build(E, k=2, num_gates=2 * T), same, T, 10)
    torch.testing.assert_close(s.schedule(0), torch.full((2 * T,), 0.1, dtype=torch.float64))
    torch.testing.assert_close(s.schedule(30), torch.full((2 * T,), 0.5, dtype=torch.float64))


def test_bank_search_scores_each_member_task_gate_on_a_fixed_probe() -> None:
    from dselectk.search import RefitStats, selector_refit_mse
    from dselectk.variants import SearchPlan

    m = _bank([1, 2], "topk")
    x, y = torch.randn(50, P), torch.randn(50, T)
    plan = SearchPlan(at=(0.5,), probe=16)
    search = plan.bank_callback(m, x, y, total_steps=10, seed=3)
    assert search.gate is m.gates and sorted(search._at) == [5]
    idx = torch.randperm(50, generator=torch.Generator().manual_seed(3))[:16]
    pred, _ = m(x[idx])
    want = ((pred - y[idx].T) ** 2).mean(-1).flatten()  # (R·T,): gate r·T + t
    torch.testing.assert_close(search.member_loss(), want)
    refit = SearchPlan(at=(0.5,), probe=16, refit=True).bank_callback(m, x, y, 10, seed=3)
    stats = RefitStats.of(m.expert_outputs(x[idx]), y[idx].T)
    torch.testing.assert_close(refit.member_loss(), selector_refit_mse(m.gates, stats))
