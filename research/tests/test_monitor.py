"""The training monitor of gate convergence and expert FLOPs (:mod:`dselectk_research.monitor`)."""

from __future__ import annotations

import torch

from dselectk.gates import make_gate
from dselectk.layers.experts import StackedMLP
from dselectk.models.moe import MultiGateMoE
from dselectk.training import TaskData, TrainConfig, train
from dselectk_research.cnn import make_towers
from dselectk_research.monitor import GateMonitor, gate_metrics


def test_monitor_measures_a_training_run() -> None:
    torch.manual_seed(0)
    experts = StackedMLP(4, 6, [8], final_activation=True)
    gates = make_gate("dselect_k", 4, k=2, num_gates=2)
    model = MultiGateMoE(experts, gates, make_towers(2, 8, (8, 1)))
    data = TaskData(torch.randn(64, 6), [torch.randn(64, 1), torch.randn(64, 1)])
    mon = GateMonitor(model, check_every=1, record_every=2)
    cfg = TrainConfig(optimizer="adam", lr=0.01, batch_size=16, epochs=1, progress=False)
    hist = train(model, data, ["mse", "mse"], cfg, callbacks=[mon])
    assert hist.steps == 4 and mon.examples == 64 and len(mon.needed_per_step) == 4
    metrics, extra = mon.results(hist.steps, 2, expert_flops=10.0, trajectory=True)
    # a static gate: the same experts (at most 4) for every example of every step
    assert 1.0 <= metrics["mean_experts_needed"] <= 4.0
    assert metrics["train_expert_flops"] == 3 * 10.0 * metrics["mean_experts_needed"] * 64
    assert metrics["binary_reached"] in (0.0, 1.0) and "binary_reached_task2" in metrics
    assert extra["trajectory"]["steps"] == [1, 2, 4]
    assert len(extra["binary_checks"]["steps"]) == 4
    gm, ge = gate_metrics(model, data.x)
    assert 1.0 <= gm["selected_experts"] <= 4.0 and len(ge["gate_weights"]) == 2


def test_step_timer_leaves_out_the_warm_up_steps() -> None:
    import math

    from dselectk.training import History
    from dselectk_research.monitor import StepTimer

    timer, hist = StepTimer(warmup=2), History()
    assert math.isnan(timer.per_step())
    for step in range(1, 6):
        hist.steps = step
        timer.on_step(
            torch.nn.Linear(1, 1), TaskData(torch.zeros(1, 1), [torch.zeros(1)]), None, hist
        )
    assert timer.steps == 3 and timer.t0 is not None and timer.per_step() > 0
    model = torch.nn.Linear(4, 1)
    data = TaskData(torch.randn(48, 4), [torch.randn(48, 1)])
    cfg = TrainConfig(lr=0.01, batch_size=4, epochs=1, progress=False)
    timer = StepTimer()  # 10 warm-up steps by default: 2 of the 12 timed
    train(model, data, None, cfg, callbacks=[timer], loss_fn=lambda m, b: (m(b.x).sum(), None))
    assert timer.steps == 2 and 0 < timer.per_step() < 1


def test_gate_trajectory_records_the_chosen_rows_at_step_0_and_every_n_steps() -> None:
    import pytest

    from dselectk.training import History
    from dselectk_research.monitor import GateTrajectory

    gate = make_gate("topk", 6, k=2, num_gates=3)
    traj = GateTrajectory(gate, [0, 2], every=2, digits=3)
    hist, batch = History(), TaskData(torch.zeros(1, 1), [torch.zeros(1)])
    for step in range(1, 6):
        hist.steps = step
        traj.on_step(torch.nn.Linear(1, 1), batch, None, hist)
    w = gate.expert_weights()
    assert set(traj.trajectories) == {0, 2}
    for r, tr in traj.trajectories.items():
        assert tr["steps"] == [0, 2, 4]
        assert tr["weights"][-1] == [round(float(v), 3) for v in w[r]]
    assert GateTrajectory(gate, [], every=1).trajectories == {}
    with pytest.raises(ValueError, match="every"):
        GateTrajectory(gate, [0], every=0)
