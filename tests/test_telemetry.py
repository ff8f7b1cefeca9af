"""Routing telemetry: the numbers on hand-built gates, the writers, and use inside ``train``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from dselectk import telemetry as tel_mod
from dselectk.gates import DSelectK, SoftmaxGate, TopKGate
from dselectk.gates.ablation import SoftmaxSelectorGate
from dselectk.layers import StackedMLP
from dselectk.models import MultiGateMoE
from dselectk.telemetry import RoutingTelemetry, find_gates, flatten_record, gate_stats
from dselectk.training import TaskData, TrainConfig, train

BIG = 10.0  # |z| >> γ/2: S(z) is exactly 0 or 1


def _codes_bank(codes: list[list[int]], num_experts: int = 8, gamma=1.0) -> DSelectK:
    """A static DSelect-k bank whose selectors sit exactly on ``codes`` (α = 0: equal mix)."""
    t, k = len(codes), len(codes[0])
    gate = DSelectK(num_experts, k, num_gates=t, gamma=gamma)
    m = gate.num_bits
    with torch.no_grad():
        gate.alpha.zero_()
        for i, row in enumerate(codes):
            for j, c in enumerate(row):
                for b in range(m):
                    gate.z[i, j, b] = BIG if (c >> b) & 1 else -BIG
    return gate


def test_dselectk_bank_known_codes():
    gate = _codes_bank([[1, 1, 5], [2, 3, 4], [7, 7, 7]], gamma=[1.0, 2.0, 3.0])
    t0, t1, t2 = gate_stats(gate)
    assert [s["collisions"] for s in (t0, t1, t2)] == [1.0, 0.0, 3.0]
    assert [s["experts"] for s in (t0, t1, t2)] == [2.0, 3.0, 1.0]
    assert [s["experts_used"] for s in (t0, t1, t2)] == [2.0, 3.0, 1.0]
    assert t0["load"] == pytest.approx([0, 2 / 3, 0, 0, 0, 1 / 3, 0, 0])
    assert t0["routed"] == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert t2["load"] == pytest.approx([0] * 7 + [1])
    for s in (t0, t1, t2):
        assert s["binary_fraction"] == 1.0 and s["binary"] == 1.0
        assert s["selector_entropy"] == 0.0
        assert s["entropy_reg"] == 0.0
    assert [s["gamma"] for s in (t0, t1, t2)] == [1.0, 2.0, 3.0]  # per-gate γ
    assert t1["weight_entropy"] == pytest.approx(math.log(3))
    assert t2["weight_entropy"] == pytest.approx(0.0)


def test_dselectk_partly_binary_and_unused_codes():
    gate = _codes_bank([[1, 2]], num_experts=8)
    with torch.no_grad():
        gate.z[0, 1, 2] = 0.0  # S = 1/2: rounds to 0, so the code stays 2
    (s,) = gate_stats(gate)
    assert s["binary_fraction"] == pytest.approx(1 - 1 / 6)
    assert s["binary"] == 0.0
    assert s["selector_entropy"] == pytest.approx(math.log(2) / 2)  # one bit of two selectors
    assert s["collisions"] == 0.0
    # n = 5 (3 bits): two selectors on code 6 select no expert, so they do not collide
    gate5 = _codes_bank([[6, 6, 1, 1]], num_experts=5)
    (s5,) = gate_stats(gate5)
    assert s5["collisions"] == 1.0  # only the pair on expert 1
    assert s5["experts"] == 1.0


def test_per_example_gates_in_multigate_moe_see_the_bottom_output():
    torch.manual_seed(0)
    # gate 0: per-example DSelect-k, k=1, n=4: bit 0 = sign of the bottom's first feature,
    # bit 1 always 1, so half the examples go to expert 3 and half to expert 2
    g0 = DSelectK(4, 1, in_features=5)
    with torch.no_grad():
        g0.proj.weight.zero_()
        g0.proj.bias.zero_()
        g0.proj.weight[1, 0] = 100.0  # logits: [α, z_bit0, z_bit1]
        g0.proj.bias[2] = BIG
    g1 = SoftmaxGate(4)  # static, uniform
    bottom = nn.Linear(3, 5)  # the gate sees the bottom's 5 features, not x's 3
    model = MultiGateMoE(StackedMLP(4, 5, [3], final_activation=True), [g0, g1], bottom=bottom)
    with torch.no_grad():
        model.bottom.weight.zero_()
        model.bottom.bias.zero_()
        model.bottom.weight[0, 0] = 1.0
    x = torch.cat([torch.ones(6, 3), -torch.ones(6, 3)])
    model.train()
    tel = RoutingTelemetry(None, every=1)
    rec = tel.log(model, 1, batch=TaskData(x, [x[:, :1], x[:, :1]]))
    assert rec is not None
    assert set(rec["gates"]) == {"gates/task0", "gates/task1"}
    s0, s1 = rec["gates"]["gates/task0"], rec["gates"]["gates/task1"]
    assert s0["experts"] == 1.0 and s0["experts_used"] == 2.0
    assert s0["routed"] == [0.0, 0.0, 0.5, 0.5]
    assert s0["load"] == pytest.approx([0.0, 0.0, 0.5, 0.5])
    assert s0["binary"] == 1.0 and s0["collisions"] == 0.0
    assert s1["experts"] == 4.0 and s1["load"] == pytest.approx([0.25] * 4)
    assert all(m.training for m in model.modules())  # modes restored
    assert tel.probe is not None and tel.probe.shape == (12, 3)
    wrapped = nn.Sequential(model)  # names follow the module paths, unless module= is given
    assert "0/gates/task0" in RoutingTelemetry(None).log(wrapped, 1, batch=x)["gates"]
    inner = RoutingTelemetry(None, module=model).log(wrapped, 1, batch=x)
    assert inner["gates"]["gates/task0"] == s0


def test_bank_names_tokens_and_other_gates():
    model = MultiGateMoE(
        StackedMLP(4, 3, [2], final_activation=True), TopKGate(4, 2, in_features=3, num_gates=2)
    )
    names = [n for n, _ in find_gates(model)]
    assert names == ["gates"]
    rec = RoutingTelemetry(None).log(model, 5, batch=TaskData(torch.randn(7, 3), [torch.ones(7)]))
    assert rec is not None and set(rec["gates"]) == {"gates/task0", "gates/task1"}
    assert rec["gates"]["gates/task1"]["experts"] == 2.0
    # tokens (B, S, p) are examples; a softmax-selector gate has collisions and entropies
    (s,) = gate_stats(TopKGate(6, 3, in_features=4), torch.randn(2, 5, 4))
    assert s["experts"] == 3.0 and sum(s["routed"]) == pytest.approx(3.0)
    ab = SoftmaxSelectorGate(4, 2, num_gates=2, temperature=[1.0, 0.5])
    stats = gate_stats(ab)
    assert [st["temperature"] for st in stats] == [1.0, 0.5]
    assert all("collisions" in st and "selector_entropy" in st for st in stats)
    assert "binary_fraction" not in stats[0]


def _tiny_model() -> tuple[MultiGateMoE, TaskData]:
    torch.manual_seed(0)
    gates = DSelectK(4, 2, num_gates=2, in_features=6, gamma=1.0, entropy_reg=0.1)
    experts = StackedMLP(4, 6, [8], final_activation=True)
    towers = StackedMLP(2, 8, [4, 1], final_activation=False)
    model = MultiGateMoE(experts, gates, towers)
    x = torch.randn(64, 6)
    return model, TaskData(x, [x[:, :1].clone(), x[:, 1:2].clone()])


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(batch_size=16, epochs=2, progress=False, **kw)


def test_train_jsonl_every_n_steps(tmp_path):
    model, data = _tiny_model()
    tel = RoutingTelemetry(tmp_path, every=3, backend="jsonl")
    calls = []
    orig = tel.log
    tel.log = lambda *a, **k: calls.append(a[1]) or orig(*a, **k)  # type: ignore[method-assign]
    hist = train(model, data, "mse", _cfg(), callbacks=[tel])
    assert hist.steps == 8
    assert calls == [3, 6]  # nothing on the other steps
    lines = (tmp_path / "routing.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert [r["step"] for r in recs] == [3, 6]
    assert [r["epoch"] for r in recs] == [1, 2]
    g = recs[-1]["gates"]["gates/task1"]
    assert len(g["load"]) == 4 and len(g["routed"]) == 4
    for key in ("experts", "binary_fraction", "collisions", "selector_entropy", "gamma"):
        assert key in g
    assert g["entropy_reg"] == pytest.approx(0.1)
    assert recs == json.loads(json.dumps(tel.records))  # the file holds what was logged
    tel.close()


def test_auto_falls_back_to_jsonl_with_one_warning(tmp_path, monkeypatch):
    def missing():
        raise ImportError("no tensorboard")

    monkeypatch.setattr(tel_mod, "_summary_writer_class", missing)
    with pytest.warns(RuntimeWarning, match="tensorboard is not installed"):
        tel = RoutingTelemetry(tmp_path, every=1)
    assert tel.backend == "jsonl" and tel.jsonl_path == tmp_path / "routing.jsonl"
    with pytest.raises(ImportError):
        RoutingTelemetry(tmp_path / "tb", backend="tensorboard")
    model, data = _tiny_model()
    tel.log(model, 1, batch=data)
    tel.log(model, 2, batch=data)
    assert len((tmp_path / "routing.jsonl").read_text().splitlines()) == 2  # flushed already
    tel.close()


def test_tensorboard_events_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, data = _tiny_model()
    with RoutingTelemetry(tmp_path, every=4, backend="both") as tel:
        train(model, data, "mse", _cfg(), callbacks=[tel])
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"gates/task0/binary_fraction", "gates/task1/collisions", "gates/task0/gamma"} <= tags
    assert "gates/task1/load/expert3" in tags and "gates/task0/routed/expert0" in tags
    for tag, want in flatten_record(tel.records[-1]).items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [4, 8]
        assert events[-1].value == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert len((tmp_path / "routing.jsonl").read_text().splitlines()) == 2


def test_arguments_checked():
    with pytest.raises(ValueError, match="backend"):
        RoutingTelemetry(None, backend="csv")
    with pytest.raises(ValueError, match="every"):
        RoutingTelemetry(None, every=0)
    with pytest.raises(ValueError, match="per-example"):
        gate_stats(DSelectK(4, 2, in_features=3))
