"""train()'s swap search (TrainConfig.search): a static sparse gate ends on k distinct experts
without hand-wiring, the default runs only where it can, and it can be turned off."""

from __future__ import annotations

import pytest
import torch

from dselectk.gates import DSelectK, TopKGate
from dselectk.layers import StackedMLP, make_towers
from dselectk.models import MoE, MultiGateMoE
from dselectk.search import SearchPlan, model_searches
from dselectk.training import TaskData, TrainConfig, train


def _toy(seed: int = 0) -> TaskData:
    """A new user's own data: 3 regression tasks of any sign on 6 features."""
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(2000, 6, generator=g)
    ys = [x[:, :1] * 2 - x[:, 1:2], torch.sin(x[:, 2:3]) - 1.5, x[:, 3:4] * x[:, 4:5] - x[:, 5:6]]
    return TaskData(x, ys)


def _mmoe(gates: object, seed: int = 0) -> MultiGateMoE:
    torch.manual_seed(seed)
    return MultiGateMoE(
        StackedMLP(8, 6, [16], final_activation=True), gates, make_towers(3, 16, [8, 1])
    )


def _cfg(**kw: object) -> TrainConfig:
    settings: dict[str, object] = {"epochs": 5, "batch_size": 64, "progress": False, "seed": 0}
    return TrainConfig(**{**settings, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [0, 1])
def test_toy_mmoe_with_k_2_selects_2_distinct_experts_per_task(seed: int) -> None:
    model = _mmoe(DSelectK(8, k=2, num_gates=3), seed)
    train(model, _toy(seed), "mse", _cfg())  # the recommended call: no flag
    sel = model.gates.selection()  # (T, k)
    assert sel.shape == (3, 2)
    assert model.gates.selection_is_final().all()
    for t in range(3):
        assert len(set(sel[t].tolist())) == 2, f"task {t} selected {sel[t].tolist()}"
    w = model.gates()[0].detach()  # (T, n): exactly 2 experts carry weight per task
    assert ((w > 0).sum(-1) == 2).all()


def test_search_none_leaves_the_selection_to_gradient_descent() -> None:
    # the same run without the search: the selectors of a task meet on one expert (the failure
    # the default search removes); with the search the selection differs
    off = _mmoe(DSelectK(8, k=2, num_gates=3))
    train(off, _toy(), "mse", _cfg(search=None))
    on = _mmoe(DSelectK(8, k=2, num_gates=3))
    train(on, _toy(), "mse", _cfg())
    distinct_off = [len(set(r)) for r in off.gates.selection().tolist()]
    assert distinct_off != [2, 2, 2] or not bool(off.gates.selection_is_final().all())
    assert [len(set(r)) for r in on.gates.selection().tolist()] == [2, 2, 2]


def test_a_list_of_gates_and_topk_are_searched_per_task() -> None:
    gates = [DSelectK(8, k=2), TopKGate(8, k=2), DSelectK(8, k=2, in_features=6)]
    model = _mmoe(gates)
    searches = model_searches(model, _toy(), [torch.nn.functional.mse_loss] * 3, "auto", 100)
    assert [s.gate for s in searches] == gates[:2]  # the per-example gate is not searchable
    assert searches[0]._binarize_at == {50} and searches[1]._binarize_at == set()
    assert searches[1]._at == {25, 50, 70, 85}
    train(model, _toy(), "mse", _cfg(epochs=2))
    assert len(set(gates[0].selection().tolist())) == 2


def test_single_moe_is_searched_and_loss_fn_turns_auto_off() -> None:
    data = TaskData(_toy().x, [_toy().ys[0]])
    torch.manual_seed(0)
    model = MoE(StackedMLP(8, 6, [4, 1], final_activation=False), DSelectK(8, k=2))
    train(model, data, "mse", _cfg(epochs=2))
    assert len(set(model.gate.selection().tolist())) == 2
    assert model.gate.selection_is_final().all()
    calls = []

    def loss_fn(m: torch.nn.Module, batch: TaskData) -> tuple[torch.Tensor, object]:
        out = m(batch.x)
        calls.append(1)
        return ((out.output - batch.ys[0]) ** 2).mean() + out.aux_loss, out

    torch.manual_seed(0)
    model2 = MoE(StackedMLP(8, 6, [4, 1], final_activation=False), DSelectK(8, k=2))
    train(model2, data, None, _cfg(epochs=1), loss_fn=loss_fn)
    assert len(calls) == 32  # only training steps: no probe passes of a search


def test_bad_search_settings_are_named() -> None:
    with pytest.raises(ValueError, match="search must be"):
        TrainConfig(search="on")
    model = _mmoe(DSelectK(8, k=2, num_gates=3))
    with pytest.raises(ValueError, match="refit"):
        train(model, _toy(), "mse", _cfg(search=SearchPlan(at=(0.5,), refit=True)))
    plain = torch.nn.Linear(6, 1)
    with pytest.raises(ValueError, match="no searchable static gate"):
        train(plain, TaskData(_toy().x, [_toy().ys[0]]), "mse", _cfg(search=SearchPlan((0.5,))))


def test_an_explicit_plan_runs_on_its_steps() -> None:
    model = _mmoe(DSelectK(8, k=2, num_gates=3))
    plan = SearchPlan(at=(0.5,), binarize=0.5)
    searches = model_searches(model, _toy(), [torch.nn.functional.mse_loss] * 3, plan, 160)
    assert searches[0]._at == {80} and searches[0]._binarize_at == {80}
    # a model without a searchable gate and "auto": nothing to search, nothing raised
    assert model_searches(torch.nn.Linear(6, 1), _toy(), [], "auto", 10) == []
