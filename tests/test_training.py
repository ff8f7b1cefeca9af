"""Training loop and schedules."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dselectk.gates import DSelectK, SoftmaxSelectorGate
from dselectk.layers import StackedMLP
from dselectk.models import MultiGateMoE
from dselectk.schedules import (
    AttributeScheduler,
    ConstantSchedule,
    DelayedSchedule,
    GeometricSchedule,
    LinearSchedule,
)
from dselectk.training import GateRecorder, History, TaskData, TrainConfig, evaluate, train


def make_problem(num_tasks: int = 2, n: int = 400) -> tuple[MultiGateMoE, TaskData]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    ys = [(x[:, t] * 2 + x[:, (t + 1) % 4]).unsqueeze(-1) for t in range(num_tasks)]
    model = MultiGateMoE(
        StackedMLP(4, 4, [8], final_activation=True),
        DSelectK(4, 2, num_gates=num_tasks, gamma=2.0, entropy_reg=0.01),
        StackedMLP(num_tasks, 8, [1], activation="identity"),
    )
    return model, TaskData(x, ys)


def test_training_reduces_loss_and_is_reproducible() -> None:
    results = []
    for _ in range(2):
        torch.manual_seed(0)
        model, data = make_problem()
        hist = train(
            model, data, "mse", TrainConfig(lr=0.02, epochs=6, batch_size=64, progress=False)
        )
        results.append((hist.train_loss, [p.detach().clone() for p in model.parameters()]))
    assert results[0][0][-1] < results[0][0][0]
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_loss_is_weighted_sum_over_tasks_plus_aux() -> None:
    torch.manual_seed(0)
    model, data = make_problem(num_tasks=3, n=64)
    cfg = TrainConfig(
        optimizer="sgd",
        lr=1e-9,
        epochs=1,
        batch_size=64,
        progress=False,
        task_weights=[1.0, 2.0, 0.5],
    )
    with torch.no_grad():
        out = model(data.x)
        per_task = [((o - y) ** 2).mean() for o, y in zip(out.outputs, data.ys)]
        expected = float(per_task[0] + 2 * per_task[1] + 0.5 * per_task[2] + out.aux_loss)
    hist = train(model, data, "mse", cfg)
    assert math.isclose(hist.train_loss[0], expected, rel_tol=1e-5)


def test_early_stopping_restores_best_and_records_trajectories() -> None:
    torch.manual_seed(0)
    model, data = make_problem()
    val = TaskData(data.x[:100], [y[:100] + 5.0 * torch.randn(100, 1) for y in data.ys])
    cfg = TrainConfig(lr=0.5, epochs=30, batch_size=50, progress=False, early_stopping_patience=2)
    hist = train(
        model, data, "mse", cfg, val_data=val, callbacks=[GateRecorder(4, probe=data.x[:1024])]
    )
    assert hist.best_epoch is not None
    if hist.stopped_early:
        best = sum(hist.val_losses[hist.best_epoch])
        now = sum(evaluate(model, val, "mse")["loss"])
        assert math.isclose(now, best, rel_tol=1e-5)
    assert hist.recorded_steps[:2] == [4, 8]
    assert hist.recorded_weights[0].shape == (2, 4)


def test_gate_recorder_runs_in_callback_order() -> None:
    seen: list[int] = []

    def run(recorder_first: bool) -> tuple[History, list[torch.Tensor]]:
        seen.clear()
        torch.manual_seed(0)
        model, data = make_problem(n=200)
        cfg = TrainConfig(lr=0.05, epochs=2, batch_size=40, progress=False)
        cbs: list = [lambda _m, h: seen.append(len(h.recorded_steps))]
        cbs.insert(0 if recorder_first else 1, GateRecorder(3, probe=data.x[:1024]))
        hist = train(model, data, "mse", cfg, callbacks=cbs)
        return hist, [p.detach().clone() for p in model.parameters()]

    after, params_a = run(recorder_first=False)
    steps_a = list(seen)
    before, params_b = run(recorder_first=True)
    assert seen != steps_a  # the recorder runs where it is listed, after the earlier callbacks
    assert seen[2] == steps_a[2] + 1 == 1  # step 3: recorded before / after the lambda
    assert after.recorded_steps == before.recorded_steps == [3, 6, 9]
    for a, b in zip(after.recorded_weights, before.recorded_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="every"):
        GateRecorder(0, probe=torch.zeros(1, 4))


def test_gate_observers_do_not_change_the_run() -> None:
    """The gate observers (GateRecorder, RoutingTelemetry) run the probe in eval mode: with
    dropout experts, a run observed every step ends with the weights of a run not observed (no
    RNG draws), and the modules are back in training mode after each observation."""
    from dselectk.telemetry import RoutingTelemetry

    def run(observe: bool) -> tuple[list[torch.Tensor], History]:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(120, 4, generator=g)
        data = TaskData(x, [x[:, :1], x[:, 1:2]])
        model = MultiGateMoE(
            StackedMLP(4, 4, [8], dropout=0.5, final_activation=True),
            DSelectK(4, 2, num_gates=2, gamma=2.0),
            StackedMLP(2, 8, [1], activation="identity"),
        )
        modes: list[bool] = []
        cbs: list = []
        if observe:
            cbs = [GateRecorder(1, probe_size=16), RoutingTelemetry(None, every=2)]
            cbs.append(lambda m, _h: modes.append(all(s.training for s in m.modules())))
        cfg = TrainConfig(lr=0.05, epochs=2, batch_size=40, progress=False, search=None)
        hist = train(model, data, "mse", cfg, callbacks=cbs)
        assert all(modes)
        return [p.detach().clone() for p in model.parameters()], hist

    plain, _ = run(False)
    observed, hist = run(True)
    for a, b in zip(plain, observed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert hist.recorded_steps == [1, 2, 3, 4, 5, 6]
    assert hist.recorded_weights[0].shape == (2, 4)


def test_schedulers_are_stepped_by_the_loop() -> None:
    torch.manual_seed(0)
    model, data = make_problem(n=128)
    gates = model.gates
    sched = AttributeScheduler(gates, "gamma", GeometricSchedule(2.0, 0.02, steps=8))
    lam = AttributeScheduler(gates, "entropy_reg", LinearSchedule(0.0, 1.0, steps=8))
    train(
        model,
        data,
        "mse",
        TrainConfig(epochs=2, batch_size=32, progress=False),
        schedulers=[sched, lam],
    )
    assert sched.last_step == 8
    assert gates.gamma == pytest.approx(0.02) and gates.entropy_reg == pytest.approx(1.0)


def test_evaluate_reports_accuracy_for_classification() -> None:
    x = torch.randn(50, 4)
    model = MultiGateMoE(
        StackedMLP(4, 4, [3], final_activation=True), SoftmaxSelectorGate(4, 2, num_gates=1)
    )
    res = evaluate(model, TaskData(x, [torch.randint(0, 3, (50,))]), "ce")
    assert 0.0 <= res["accuracy"][0] <= 1.0 and res["loss"][0] > 0
    res = evaluate(model, TaskData(x, [torch.randn(50, 3)]), "mse")
    assert math.isnan(res["accuracy"][0])


def test_train_argument_errors() -> None:
    model, data = make_problem()
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="rmsprop")
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="one loss per task"):
        train(model, data, ["mse"], TrainConfig(progress=False))
    with pytest.raises(ValueError, match="unknown loss"):
        train(model, data, "hinge", TrainConfig(progress=False))
    with pytest.raises(ValueError, match="task_weights"):
        train(model, data, "mse", TrainConfig(progress=False, task_weights=[1.0]))
    with pytest.raises(ValueError, match="val_data"):
        train(model, data, "mse", TrainConfig(progress=False, early_stopping_patience=1))
    with pytest.raises(ValueError, match="ys\\[1\\]"):
        TaskData(torch.randn(5, 2), [torch.randn(5), torch.randn(4)])


def test_schedules() -> None:
    geo = GeometricSchedule(1e-2, 1e-16, steps=14)
    assert geo(0) == pytest.approx(1e-2) and geo(14) == pytest.approx(1e-16)
    assert geo(7) == pytest.approx(1e-9)  # evenly spaced on a log scale
    assert geo(100) == pytest.approx(1e-16)
    lin = LinearSchedule(1.0, 3.0, steps=4)
    assert [lin(i) for i in range(6)] == [1.0, 1.5, 2.0, 2.5, 3.0, 3.0]
    assert DelayedSchedule(ConstantSchedule(2.0), delay=3)(2) == 0.0
    assert DelayedSchedule(ConstantSchedule(2.0), delay=3)(3) == 2.0
    with pytest.raises(ValueError, match="log-scale"):
        GeometricSchedule(0.0, 1.0, steps=3)


def test_attribute_scheduler_state_round_trip() -> None:
    gate = DSelectK(8, 2, gamma=1.0)
    s = AttributeScheduler(gate, "gamma", LinearSchedule(4.0, 2.0, steps=4))
    assert gate.gamma == 4.0
    s.step()
    s.step()
    state = s.state_dict()
    gate2 = DSelectK(8, 2)
    s2 = AttributeScheduler(gate2, "gamma", LinearSchedule(4.0, 2.0, steps=4))
    s2.load_state_dict(state)
    assert gate2.gamma == gate.gamma == 3.0
    with pytest.raises(ValueError, match="no attribute"):
        AttributeScheduler(gate, "temperature", ConstantSchedule(1.0))


def test_checkpoint_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    calls: list[int] = []

    def run(ckpt: Path, interrupt_at: int | None) -> MultiGateMoE:
        torch.manual_seed(0)
        model, data = make_problem(n=96)
        sched = AttributeScheduler(model.gates, "gamma", GeometricSchedule(2.0, 0.5, steps=12))

        def stop(_: torch.nn.Module, hist: History) -> None:
            calls.append(hist.steps)
            if interrupt_at is not None and hist.steps == interrupt_at:
                raise KeyboardInterrupt

        cfg = TrainConfig(epochs=4, batch_size=32, progress=False, checkpoint=ckpt, seed=3)
        train(model, data, "mse", cfg, schedulers=[sched], callbacks=[stop])
        return model

    reference = run(tmp_path / "a.pt", None)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b.pt", interrupt_at=8)  # mid-epoch 3: epochs 1-2 are checkpointed
    assert not list(tmp_path.glob(".*tmp*"))  # no half-written checkpoint
    calls.clear()
    resumed = run(tmp_path / "b.pt", None)
    assert calls == list(range(7, 13))  # only epochs 3-4 ran again (3 steps per epoch)
    for a, b in zip(reference.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_callbacks_see_the_end_of_training_also_on_an_error() -> None:
    from dselectk.training import Callback

    class Ends(Callback):
        def __init__(self) -> None:
            self.ended: list[int] = []

        def on_train_end(self, model: torch.nn.Module, history: History) -> None:
            self.ended.append(history.steps)

    model, data = make_problem()
    ends = Ends()
    train(model, data, "mse", TrainConfig(epochs=1, batch_size=64, progress=False),
          callbacks=[ends])  # fmt: skip
    assert ends.ended == [math.ceil(len(data) / 64)]

    def boom(model: torch.nn.Module, history: History) -> None:
        raise RuntimeError("stop")

    ends = Ends()
    with pytest.raises(RuntimeError, match="stop"):
        train(model, data, "mse", TrainConfig(epochs=1, progress=False), callbacks=[ends, boom])
    assert ends.ended == [1]
