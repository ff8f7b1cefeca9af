"""The typed variant vocabulary and the registry's hyperparameter declarations."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import torch

from dselectk.gates import GATES, DSelectK, DSelectKExtended, gate_names, gate_spec, make_gate
from dselectk.schedules import DelayedSchedule, GeometricSchedule, LinearSchedule
from dselectk.variants import Ramp, SearchPlan, Variant, variant_table


@pytest.mark.parametrize("name", gate_names())
def test_declared_hyperparameters_are_constructor_arguments_with_their_defaults(name: str) -> None:
    spec = gate_spec(name)
    cls = {"ablation_annealing": "SoftmaxSelectorGate"}.get(name)
    factory = spec.factory if cls is None else type(make_gate(name, 8, k=2))
    params = inspect.signature(factory).parameters
    assert ("k" in params) == spec.takes_k
    for h in spec.hparams.values():
        assert h.name in params, (name, h.name)
        assert params[h.name].default == h.default, (name, h.name)
        assert h.check(h.default) == h.default
    for h in spec.hparams.values():  # schedulable ones are buffers a schedule can set
        if h.schedulable:
            gate = make_gate(name, 8, **({"k": 2} if spec.takes_k else {}))
            setattr(gate, h.name, 0.5)
            assert float(getattr(gate, h.name)) == 0.5


def test_checks_name_the_argument_and_the_range() -> None:
    spec = gate_spec("dselect_k")
    with pytest.raises(ValueError, match=r"--gamma: expected a number > 0, got -1"):
        spec.hparams["gamma"].check(-1.0, "--gamma")
    extended = gate_spec("dselect_k_extended")
    with pytest.raises(ValueError, match=r"init: expected one of 'paper', 'spread'"):
        extended.check({"init": "distinct"})
    with pytest.raises(ValueError, match=r"no hyperparameter 'lr'.*\['distinct', 'diversity'"):
        extended.check({"lr": 0.1})
    with pytest.raises(ValueError, match="entropy_reg"):
        make_gate("dselect_k", 8, k=2, entropy_reg=float("nan"))
    assert spec.hparams["gamma"].check([1, 2.5]) == [1.0, 2.5]  # one value per gate of a bank
    assert spec.hparams["gamma"].check(torch.tensor([1.0])).tolist() == [1.0]
    with pytest.raises(ValueError, match="noisy: expected true or false"):
        gate_spec("topk").check({"noisy": 1})


def test_ramp_reproduces_the_study_schedules_it_replaces() -> None:
    steps = 1000
    # recovery's λ warm-up: 0 for 40 %, linear 0 -> λ over 20 %
    warm = Ramp("entropy_reg", start=0.0, delay=0.4, span=0.2).schedule(0.1, steps)
    old = DelayedSchedule(LinearSchedule(0.0, 0.1, 200), 400)
    assert [warm(s) for s in range(0, steps, 7)] == [old(s) for s in range(0, steps, 7)]
    # recovery's γ anneal: γ for 60 %, geometric to γ·1e-3 over 30 %
    ann = Ramp("gamma", end_factor=1e-3, delay=0.6, span=0.3, shape="geometric")
    sched = ann.schedule(10.0, steps)
    held = DelayedSchedule(GeometricSchedule(10.0, 10.0 * 1e-3, 300), 600, 10.0)
    assert [sched(s) for s in range(0, steps, 7)] == [held(s) for s in range(0, steps, 7)]
    # synthetic's λ ramp after a warm-up with λ = 0: λ -> λ_end over the rest
    ramp = Ramp("entropy_reg", end=1.0, delay=0.25, before=0.0).schedule(0.1, steps)
    old = DelayedSchedule(LinearSchedule(0.1, 1.0, 750), 250)
    assert [ramp(s) for s in range(steps + 5)] == [old(s) for s in range(steps + 5)]
    # the annealing ablation's temperature, one start per member
    starts = torch.tensor([1e-2, 1e-4], dtype=torch.float64)
    t = Ramp("temperature", end=1e-16, shape="geometric").schedule(starts, steps)
    torch.testing.assert_close(t(500), GeometricSchedule(starts, 1e-16, steps)(500))
    for bad in ({"shape": "cubic"}, {"delay": 1.0}, {"span": 0.0}, {"end": 1.0, "end_factor": 2}):
        with pytest.raises(ValueError, match="Ramp"):
            Ramp("gamma", **bad)  # type: ignore[arg-type]


def test_variant_builds_schedules_and_states_its_identity() -> None:
    v = Variant(
        "dk_anneal",
        "dselect_k_extended",
        "DSelect-k, γ annealed",
        options={"init": "spread"},
        schedules=(Ramp("gamma", end_factor=1e-3, delay=0.5, shape="geometric"),),
        search=SearchPlan(at=(0.25, 0.75), binarize=0.5, refit=True),
    )
    torch.manual_seed(0)
    gate = v.build(16, k=4, num_gates=3, hparams={"gamma": 10.0, "entropy_reg": 0.1, "lr": 1.0})
    torch.manual_seed(0)
    ref = DSelectKExtended(16, 4, num_gates=3, gamma=10.0, entropy_reg=0.1, init="spread")
    torch.testing.assert_close(gate.logits, ref.logits, rtol=0, atol=0)
    (sched,) = v.schedulers(gate, {"gamma": 10.0}, 100)
    for _ in range(100):
        sched.step()
    assert float(gate.gamma) == pytest.approx(1e-2)
    assert v.identity() == {
        "gate": "dselect_k_extended",
        "options": {"init": "spread"},
        "schedules": [
            {
                "param": "gamma",
                "end_factor": 1e-3,
                "delay": 0.5,
                "shape": "geometric",
            }
        ],
        "search": {"at": [0.25, 0.75], "binarize": 0.5, "refit": True},
    }
    assert Variant("t", "topk", "Top-k").identity() == {"gate": "topk"}
    cb = v.search.callback(gate, lambda: torch.zeros(3), 100)  # type: ignore[union-attr]
    assert cb.at == [25, 75] and cb.binarize_at == [50]


def test_routing_is_part_of_the_identity_only_when_experts_choose() -> None:
    token = Variant("t", "softmax", "token-routed")
    expert = Variant("e", "softmax", "expert choice", routing="expert")
    assert token.routing == "token" and "routing" not in token.identity()
    assert expert.identity() == {"gate": "softmax", "routing": "expert"}
    with pytest.raises(ValueError, match="routing must be 'token' or 'expert'"):
        Variant("x", "softmax", "x", routing="tokens")


def test_variant_refuses_what_its_gate_does_not_declare() -> None:
    with pytest.raises(ValueError, match=r"variant 'x' options.*no hyperparameter 'exclusive'"):
        Variant("x", "dselect_k", "x", options={"exclusive": True})
    with pytest.raises(ValueError, match="topk cannot schedule 'gamma'"):
        Variant("y", "topk", "y", schedules=(Ramp("gamma", end=1.0),))
    with pytest.raises(ValueError, match="unknown gate 'dselectk'"):
        Variant("z", "dselectk", "z")
    v = Variant("s", "softmax", "s")
    assert v.build(8, k=3).num_experts == 8  # k is dropped for a gate without k
    with pytest.raises(ValueError, match=r"tuned\.json: gate 'topk' has no hyperparameter 'gamma'"):
        Variant("t", "topk", "t").check_hparams({"lr": 0.1, "gamma": 1.0}, "tuned.json")
    with pytest.raises(ValueError, match="two variants named 'a'"):
        variant_table(Variant("a", "topk", "a"), Variant("a", "softmax", "b"))


def test_every_registered_gate_is_a_spec() -> None:
    assert set(GATES) == set(gate_names())
    for spec in GATES.values():
        assert spec.summary


def test_stack_members_equals_members_built_alone() -> None:
    from dselectk.layers import StackedMLP
    from dselectk.variants import stack_members

    singles = []
    for seed in (3, 4):
        torch.manual_seed(seed)
        singles.append(
            (StackedMLP(4, 5, [3], final_activation=True), DSelectK(4, 2, num_gates=3, gamma=2.0))
        )
    experts = stack_members(StackedMLP(8, 5, [3], final_activation=True), [e for e, _ in singles])
    gates = stack_members(DSelectK(4, 2, num_gates=6, gamma=2.0), [g for _, g in singles])
    x = torch.randn(7, 5)
    for r, (e, g) in enumerate(singles):
        torch.testing.assert_close(gates().weights[3 * r : 3 * r + 3], g().weights)
        torch.testing.assert_close(experts(x)[4 * r : 4 * r + 4], e(x))
    single = stack_members(DSelectK(4, 2, num_gates=2), [DSelectK(4, 2), DSelectK(4, 2)])
    assert single.logits.shape == (2, 6)
    with pytest.raises(ValueError, match="'logits' of the bank has 2 rows"):
        stack_members(DSelectK(4, 2, num_gates=2), [DSelectK(4, 2)])


@pytest.mark.parametrize(
    ("hp", "message"),
    [
        ({"lr": "abc"}, r"tuned\.json\.lr: expected a finite number > 0, got 'abc'"),
        ({"lr": 0}, r"\.lr: expected a finite number > 0, got 0"),
        ({"lr": float("nan")}, r"\.lr: expected a finite number > 0"),
        ({"lr": True}, r"\.lr: expected a finite number > 0, got True"),
        ({"epochs": 0}, r"tuned\.json\.epochs: expected an integer >= 1, got 0"),
        ({"epochs": 2.5}, r"\.epochs: expected an integer >= 1, got 2\.5"),
        ({"epochs": "10"}, r"\.epochs: expected an integer >= 1, got '10'"),
    ],
)
def test_check_hparams_refuses_bad_trainer_settings(hp: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Variant("t", "topk", "t").check_hparams(hp, "tuned.json")


def test_check_hparams_keeps_good_trainer_settings() -> None:
    hp = {"lr": 0.01, "epochs": 10, "gamma": 1.0}
    assert Variant("d", "dselect_k", "d").check_hparams(hp, "t") == hp
    assert Variant("d", "dselect_k", "d").check_hparams({"epochs": 10.0}, "t") == {"epochs": 10.0}


def test_with_ramps_adds_only_the_ramps_a_variant_takes() -> None:
    """A command line's ramps go to the variants that take them: by default the hyperparameters
    the gate can schedule, or those named in ``params``; a variant given none is itself."""
    lam = Ramp("entropy_reg", end=0.1, delay=0.5, before=0.0)
    temp = Ramp("temperature", end=0.01)
    own = Ramp("gamma", end_factor=0.5)
    dk = Variant("dk", "dselect_k", "DSelect-k", schedules=(own,))
    assert dk.with_ramps([lam, temp]).schedules == (own, lam)  # temperature: not DSelect-k's
    assert dk.with_ramps([lam], params=["gamma"]) is dk
    topk = Variant("topk", "topk", "Top-k")
    assert topk.with_ramps([lam]) is topk
    abl = Variant("abl", "ablation_annealing", "annealing")
    assert abl.with_ramps([lam, temp]).schedules == (lam, temp)
    assert abl.with_ramps([lam, temp], params=["temperature"]).schedules == (temp,)


def test_a_ramp_schedules_a_gate_in_train_and_resumes_from_a_checkpoint(tmp_path: Path) -> None:
    """Ramp.scheduler is the one way to move a gate hyperparameter in train(): γ annealed
    geometrically over the run ends at its end value, and a resumed run ends where an
    uninterrupted one does (the scheduler's step count is in the checkpoint)."""
    from dselectk.gates import DSelectK
    from dselectk.layers import StackedMLP
    from dselectk.models import MultiGateMoE
    from dselectk.schedules import total_steps
    from dselectk.training import TaskData, TrainConfig, train

    def run(epochs: int, ckpt: object) -> tuple[float, float]:
        torch.manual_seed(0)
        gates = DSelectK(4, 2, num_gates=2, gamma=2.0)
        model = MultiGateMoE(
            StackedMLP(4, 3, [4], final_activation=True),
            gates,
            StackedMLP(2, 4, [1], final_activation=True),
        )
        x = torch.randn(64, 3, generator=torch.Generator().manual_seed(1))
        data = TaskData(x, [x[:, :1], x[:, 1:2]])
        cfg = TrainConfig(
            epochs=epochs, batch_size=16, progress=False, checkpoint=ckpt, search=None
        )
        steps = total_steps(4, len(data), cfg.batch_size)
        anneal = Ramp("gamma", end_factor=1e-2, shape="geometric").scheduler(gates, steps)
        train(model, data, "mse", cfg, schedulers=[anneal])
        return float(gates.gamma), float(next(model.parameters()).sum())

    gamma, weights = run(4, None)
    assert gamma == pytest.approx(0.02, rel=1e-6)  # a float32 buffer
    ckpt = tmp_path / "run.pt"
    run(2, ckpt)
    assert run(4, ckpt) == (gamma, weights)


def test_a_ramp_by_steps_and_its_checks() -> None:
    gate = make_gate("dselect_k", 4, k=2, entropy_reg=0.5)
    # by steps: 0 for 3 steps, then 0.5 -> 1.5 over 4 steps; no run length needed
    s = Ramp("entropy_reg", end=1.5, delay_steps=3, span_steps=4, before=0.0).scheduler(gate)
    seen = []
    for _ in range(9):
        seen.append(float(gate.entropy_reg))
        s.step()
    assert seen == [0.0, 0.0, 0.0, 0.5, 0.75, 1.0, 1.25, 1.5, 1.5]
    # the same ramp by fractions of a 10-step run
    by_frac = Ramp("entropy_reg", end=1.5, delay=0.3, span=0.4, before=0.0).schedule(0.5, 10)
    assert [by_frac(t) for t in range(9)] == seen
    with pytest.raises(ValueError, match="total_steps is needed"):
        Ramp("gamma", end=1.0).scheduler(gate)
    with pytest.raises(ValueError, match="no attribute 'gamma2'"):
        Ramp("gamma2", end=1.0).scheduler(gate, 10)
    with pytest.raises(ValueError, match="modules must name"):
        Ramp("gamma", end=1.0).scheduler([], 10)
    for bad, match in [
        ({"param": ""}, "Ramp.param"),
        ({"start": math.nan}, "Ramp.start must be a finite number"),
        ({"end": math.inf}, "Ramp.end must be a finite"),
        ({"before": "0"}, "Ramp.before"),
        ({"end_factor": math.nan}, "Ramp.end_factor"),
        ({"end": 0.0, "shape": "geometric"}, "Ramp.end must be > 0 for a geometric"),
        ({"start": -1.0, "shape": "geometric"}, "Ramp.start must be > 0"),
        ({"end_factor": 0.0, "shape": "geometric"}, "Ramp.end_factor must be > 0"),
        ({"delay": -0.1}, "Ramp.delay must be in"),
        ({"delay": math.nan}, "Ramp.delay must be in"),
        ({"span": 1.5}, "Ramp.span must be in"),
        ({"delay": 0.2, "delay_steps": 3}, "delay or delay_steps"),
        ({"span": 0.2, "span_steps": 3}, "span or span_steps"),
        ({"span_steps": 0}, "Ramp.span_steps must be >= 1"),
        ({"delay_steps": -1}, "Ramp.delay_steps must be >= 0"),
    ]:
        kw = {"param": "gamma", **bad}
        with pytest.raises(ValueError, match=match):
            Ramp(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="total_steps must be >= 0"):
        Ramp("gamma", end=1.0).schedule(1.0, -5)


def test_the_curves_and_the_scheduler_check_their_arguments() -> None:
    from dselectk.schedules import AttributeScheduler, ConstantSchedule, total_steps

    gate = make_gate("dselect_k", 4, k=2)
    for make, match in [
        (lambda: LinearSchedule(math.nan, 1.0, 3), "start must be a finite"),
        (lambda: LinearSchedule(0.0, torch.tensor([1.0, math.inf]), 3), "end must be finite"),
        (lambda: LinearSchedule(0.0, torch.tensor([]), 3), "end must hold at least one"),
        (lambda: GeometricSchedule(1.0, math.inf, 3), "end must be a finite"),
        (lambda: ConstantSchedule(math.nan), "value must be a finite"),
        (lambda: DelayedSchedule(ConstantSchedule(1.0), 2, before=math.nan), "before must be"),
        (lambda: DelayedSchedule(ConstantSchedule(1.0), -1), "delay must be >= 0"),
        (lambda: AttributeScheduler(gate, "", ConstantSchedule(1.0)), "attribute must be"),
        (lambda: AttributeScheduler([], "gamma", ConstantSchedule(1.0)), "modules must name"),
        (lambda: total_steps(2, 100, 0), "batch_size must be >= 1"),
        (lambda: total_steps(-1, 100, 10), "epochs must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            make()
    with pytest.raises(TypeError, match="schedule must be a Schedule"):
        AttributeScheduler(gate, "gamma", 0.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="modules must be torch modules"):
        AttributeScheduler([object()], "gamma", ConstantSchedule(1.0))  # type: ignore[list-item]
    assert total_steps(3, 1000, 128) == 24 and total_steps(0, 10, 4) == 0
