"""The library's bad-input corpus (issue: nothing silently wrong): each case gives a correct
result or a clear error, never a silently wrong value."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from dselectk import DSelectK, io
from dselectk.gates import gate_names, make_gate

K_GATES = {
    "dselect_k",
    "dselect_k_extended",
    "topk",
    "ablation_annealing",
    "ablation_entropy",
    "comet",
}


def _kw(name: str) -> dict[str, object]:
    return {"k": 2} if name in K_GATES else {}


@pytest.mark.parametrize("name", gate_names())
def test_numpy_integers_are_accepted_as_sizes(name: str) -> None:
    kw = {"k": np.int64(2)} if name in K_GATES else {}
    gate = make_gate(name, np.int64(8), num_gates=np.int32(3), **kw)
    assert type(gate.num_experts) is int and gate.num_experts == 8
    assert gate().weights.shape == (3, 8)


@pytest.mark.parametrize("name", gate_names())
@pytest.mark.parametrize("num_gates", [None, 3])
@pytest.mark.parametrize("training", [True, False])
def test_an_empty_batch_gives_empty_weights_and_zero_aux(
    name: str, num_gates: int | None, training: bool
) -> None:
    gate = make_gate(name, 8, in_features=4, num_gates=num_gates, **_kw(name))
    gate.train(training)
    out = gate(torch.zeros(0, 4))
    lead = (0,) if num_gates is None else (0, num_gates)
    assert out.weights.shape == (*lead, 8)
    assert float(out.aux_loss.detach()) == 0.0  # used to be nan (0 / 0) for several gates


def test_noisy_topk_with_balancing_on_an_empty_batch() -> None:
    gate = make_gate("topk", 8, k=2, in_features=4, noisy=True, balance_weight=0.1)
    gate.train()
    out = gate(torch.zeros(0, 4))
    assert out.weights.shape == (0, 8) and torch.isfinite(out.aux_loss)


def test_static_only_attributes_of_a_per_example_gate_say_why() -> None:
    gate = DSelectK(8, 2, in_features=4)
    with pytest.raises(AttributeError, match="alpha is a parameter of static gates only"):
        _ = gate.alpha
    with pytest.raises(AttributeError, match="z is a parameter of static gates only"):
        _ = gate.z
    assert not hasattr(gate, "alpha")  # still an AttributeError: hasattr, jit.trace rely on it


def test_written_files_get_the_usual_mode(tmp_path: Path) -> None:
    """Records and reports used to be 0600 (mkstemp's mode) while plots were 0644."""
    old = os.umask(0o022)
    try:
        for write, name in ((io.write_json, "a.json"), (io.write_text, "b.md")):
            write(tmp_path / name, {"x": 1} if name.endswith("json") else "x")
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644
    finally:
        os.umask(old)


@pytest.mark.parametrize("static", [True, False], ids=["static", "per-example"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("conditional", [True, False], ids=["conditional", "dense"])
def test_models_on_an_empty_batch(static: bool, training: bool, conditional: bool) -> None:
    """MoE and MultiGateMoE on B = 0 used to crash (static: an ambiguous reshape; per-example in
    eval: the routing path)."""
    from dselectk import MoE, MultiGateMoE
    from dselectk.layers import StackedMLP

    kw = {} if static else {"in_features": 4}
    moe = MoE(
        StackedMLP(8, 4, [6], final_activation=True), DSelectK(8, 2, **kw), conditional=conditional
    )
    moe.train(training)
    out = moe(torch.zeros(0, 4))
    assert out.output.shape == (0, 6) and float(out.aux_loss.detach()) == 0.0
    towers = StackedMLP(2, 6, [1], final_activation=False)
    gates = DSelectK(8, 2, num_gates=2, **kw)
    mmoe = MultiGateMoE(
        StackedMLP(8, 4, [6], final_activation=True), gates, towers, conditional=conditional
    )
    mmoe.train(training)
    assert [tuple(o.shape) for o in mmoe(torch.zeros(0, 4)).outputs] == [(0, 1), (0, 1)]


# -- constructor arguments: one check per class (dselectk._validate) ---------------------------
# ruff: noqa: E501
def _mtl(tasks: int = 2) -> torch.nn.Module:
    from dselectk import MultiGateMoE
    from dselectk.layers import StackedMLP, make_towers

    torch.manual_seed(0)
    return MultiGateMoE(
        StackedMLP(4, 6, [5]),
        DSelectK(4, 2, in_features=6, num_gates=tasks),
        make_towers(tasks, 5, [1]),
    )


def _flag_sites() -> list[tuple[str, object]]:
    from dselectk import MoE, SparseMoEFeedForward, SwapSearch, TrainConfig
    from dselectk.export import freeze
    from dselectk.layers import StackedMLP

    return [
        ("final_activation", lambda v: StackedMLP(2, 5, [4], final_activation=v)),
        ("renormalize", lambda v: SparseMoEFeedForward(16, 32, 4, "topk", 2, renormalize=v)),
        ("gated", lambda v: SparseMoEFeedForward(16, 32, 4, "topk", 2, gated=v)),
        ("conditional", lambda v: MoE(StackedMLP(4, 6, [3]), DSelectK(4, 2), conditional=v)),
        ("force", lambda v: freeze(_mtl().eval(), force=v)),
        ("progress", lambda v: TrainConfig(progress=v)),
        (
            "skip_nonfinite",
            lambda v: SwapSearch(
                DSelectK(8, 2, num_gates=3), lambda: torch.zeros(3), at=[1], skip_nonfinite=v
            ),
        ),
    ]


@pytest.mark.parametrize("value", ["False", "no", 1, None])
def test_a_flag_given_a_string_or_number_is_refused_not_taken_for_true(value: object) -> None:
    # bool("False") is True: a string would have switched the setting on while saying "False"
    for name, build in _flag_sites():
        if value is None and name == "renormalize":
            continue  # None is its documented default
        with pytest.raises(TypeError, match=rf"{name} must be True(, | or )False"):
            build(value)  # type: ignore[operator]
    for _, build in _flag_sites():
        build(False)  # type: ignore[operator]  # a real bool still builds


@pytest.mark.parametrize(
    ("build", "match"),
    [
        ("StackedMLP(2, 5, [4], dropout=float('nan'))", "dropout must be a finite number"),
        ("StackedMLP(2, 5, [4], dropout='0.1')", "dropout must be a number"),
        ("StackedMLP(2, 5, [4], dropout=1.0)", "dropout must be a finite number >= 0 and < 1"),
        ("SparseMoEFeedForward(16, 32, 4, 'topk', 2, capacity_factor=float('nan'))", "capacity_factor"),
        ("SparseMoEFeedForward(16, 32, 4, 'topk', 2, capacity_factor='1.25')", "capacity_factor must be a number"),
        ("SparseMoEFeedForward(16, 32, 4, 'topk', 2, capacity_factor=0.0)", "capacity_factor must be a finite number > 0"),
        ("TrainConfig(lr='0.01')", "lr must be a number"),
        ("TrainConfig(lr=float('inf'))", "lr must be a finite number > 0"),
        ("StackedMLP(2, 5, 4)", "layer_sizes must be a list or tuple of ints"),
        ("StackedMLP(2, 5, (4.0,))", r"layer_sizes\[0\] must be an int"),
        ("StackedMLP(2, 5, [4, 0])", r"layer_sizes\[1\] must be >= 1"),
        ("make_towers(2, 4, 1)", "sizes must be a list or tuple of ints"),
        ("make_towers(0, 4, [1])", "num_tasks must be >= 1"),
        ("SparseMoEFeedForward(16, 0, 4, 'topk', 2)", "d_ff must be >= 1"),
        ("SparseMoEFeedForward(16, 32, 4, 'topk', 2, routing='tokens')", "did you mean 'token'"),
        ("make_gate('dselectk', 8, k=2)", "did you mean 'dselect_k'"),
        ("make_gate('top_k', 8, k=2)", "did you mean 'topk'"),
        ("make_gate(3, 8)", "gate name must be a str"),
        ("MoEBank(StackedMLP(8, 6, [1]), DSelectK(4, 2, num_gates=4), 2.5)", "members must be an int"),
        ("MoEBank(StackedMLP(8, 6, [1]), 'dselect_k', 2)", "gates must be a dselectk Gate"),
        ("MoEBank(torch.nn.Linear(6, 1), DSelectK(4, 2, num_gates=4), 2)", "experts must be an expert bank"),
        ("MovieLensEmbedding(-5, 10)", "num_users must be >= 1"),
        ("MovieLensEmbedding(10, 10.5)", "num_items must be an int"),
        ("MovieLensEmbedding(10, 10, side=(3, 2))", "side must be"),
        ("MovieLensEmbedding(10, 10, dims={'user': 8})", r"dims must give the embedding size of \['item'\]"),
        ("verify(lambda xs: [], _mtl(), torch.randn(8, 6), seed=float('nan'))", "seed must be an int"),
    ],
)  # fmt: skip
def test_constructor_numbers_sizes_and_names_are_checked(build: str, match: str) -> None:
    from dselectk import MoEBank, SparseMoEFeedForward, TrainConfig  # noqa: F401
    from dselectk.export import verify  # noqa: F401
    from dselectk.layers import StackedMLP, make_towers  # noqa: F401
    from dselectk.layers.embedding import MovieLensEmbedding  # noqa: F401

    with pytest.raises((TypeError, ValueError), match=match):
        eval(build)  # the table above


def test_integer_inputs_to_gates_and_expert_banks_are_refused_by_dtype() -> None:
    from dselectk.layers import StackedMLP

    x = torch.ones(4, 6, dtype=torch.long)
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor, got torch\.int64"):
        DSelectK(8, 2, in_features=6)(x)
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor, got torch\.int64"):
        StackedMLP(2, 6, [4])(x)
    assert StackedMLP(2, 6, [4])(x.double().float()).shape == (2, 4, 4)


def test_train_callbacks_and_checkpoint_paths_are_checked_before_training(tmp_path: Path) -> None:
    from dselectk import TaskData, TrainConfig, train
    from dselectk.training import Callback

    data = TaskData(torch.randn(20, 6), [torch.randn(20, 1), torch.randn(20, 1)])

    def cfg(**kw: object) -> TrainConfig:
        return TrainConfig(epochs=1, batch_size=8, progress=False, threads=1, **kw)  # type: ignore[arg-type]

    model = _mtl()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="callbacks must be a list"):
        train(model, data, "mse", cfg(), callbacks=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="wrap a single one in a list"):
        train(model, data, "mse", cfg(), callbacks=Callback())  # type: ignore[arg-type]
    (tmp_path / "ckdir").mkdir()
    for path, match in (
        (tmp_path / "ckdir", "is a folder"),
        (tmp_path / "no" / "such" / "ck.pt", "does not exist"),
        ("", "must be a file path"),
    ):
        with pytest.raises(ValueError, match=match):
            train(model, data, "mse", cfg(checkpoint=path))
    # refused before any step: the model is untouched
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(ValueError, match=r"notes\.txt"):
        train(model, data, "mse", cfg(checkpoint=notes))
    assert notes.read_text() == "my notes"  # a user's file is never overwritten


def test_inputs_of_another_dtype_or_device_than_the_parameters_say_what_to_convert() -> None:
    from dselectk import TaskData, TrainConfig, train

    model = _mtl()
    x64 = torch.from_numpy(np.random.default_rng(0).normal(size=(20, 6)))  # float64, as NumPy
    with pytest.raises(
        TypeError, match=r"x is torch\.float64 but the parameters are torch\.float32"
    ):
        model(x64)
    with pytest.raises(TypeError, match=r"x\.to\(torch\.float32\)"):
        train(model, TaskData(x64, [x64[:, :1], x64[:, 1:2]]), "mse", TrainConfig(progress=False))
    with pytest.raises(ValueError, match="x is on meta but the parameters are on cpu"):
        model(torch.randn(4, 6, device="meta"))
    assert model(x64.float()).outputs[0].shape == (20, 1)  # converted: it runs
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast mixes dtypes on purpose
        assert _mtl()(torch.randn(4, 6).bfloat16()).outputs[0].shape == (4, 1)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"losses": 3}, "losses must be a loss name"),
        ({"losses": ["mse", 3]}, "each loss must be a name or a function"),
        ({"schedulers": 3}, "schedulers must be a list"),
        ({"optimizer": "adam"}, r"optimizer must be a torch\.optim\.Optimizer"),
        ({"task_weights": [0.0, 0.0]}, "task_weights are all 0"),
    ],
)
def test_train_arguments_of_the_wrong_kind_are_refused_before_training(
    kw: dict[str, object], match: str
) -> None:
    from dselectk import TaskData, TrainConfig, train

    model, data = _mtl(), TaskData(torch.randn(20, 6), [torch.randn(20, 1), torch.randn(20, 1)])
    before = [p.detach().clone() for p in model.parameters()]
    cfg = TrainConfig(epochs=1, progress=False, task_weights=kw.pop("task_weights", None))  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError), match=match):
        train(model, data, kw.pop("losses", "mse"), cfg, **kw)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize(
    ("build", "match"),
    [
        ("TrainConfig(seed='0')", "seed must be an int"),
        ("TrainConfig(seed=1.5)", "seed must be an int"),
        ("TrainConfig(shuffle_seed=-3)", "shuffle_seed must be >= 0"),
        ("TrainConfig(task_weights='11')", "task_weights must be a list of numbers"),
        ("TrainConfig(position=-1)", "position must be >= 0"),
        ("TrainConfig(desc=3)", "desc must be a str"),
        ("MultiGateMoE(StackedMLP(4, 6, [5]), DSelectK(4, 2, num_gates=2), bottom=3)", "bottom must be a module"),
        ("SparseMoEFeedForward(16, 32, 4, 'topk', 2, gate_kwargs=3)", "gate_kwargs must be a dict"),
    ],
)  # fmt: skip
def test_settings_of_the_wrong_kind_are_refused_at_construction(build: str, match: str) -> None:
    from dselectk import MultiGateMoE, SparseMoEFeedForward, TrainConfig  # noqa: F401
    from dselectk.layers import StackedMLP  # noqa: F401

    with pytest.raises((TypeError, ValueError), match=match):
        eval(build)  # the table above


def test_a_selector_count_a_gate_would_ignore_is_refused() -> None:
    from dselectk import SparseMoEFeedForward

    for gate in ("topk", "softmax", make_gate("softmax", 4, in_features=16)):
        with pytest.raises(ValueError, match="selectors=5 applies to the selector gates"):
            SparseMoEFeedForward(16, 32, 4, gate, 2, selectors=5)
    from dselectk.gates import Gate

    def gate_k(layer: torch.nn.Module) -> int:
        (gate,) = [m for m in layer.modules() if isinstance(m, Gate)]
        return int(gate.k)

    assert gate_k(SparseMoEFeedForward(16, 32, 4, "dselect_k", 2, selectors=4)) == 4
    assert gate_k(SparseMoEFeedForward(16, 32, 4, "topk", 2)) == 2  # the default: no error


def test_bank_weights_of_the_wrong_shape_are_refused() -> None:
    from dselectk import MoEBank
    from dselectk.layers import StackedMLP

    bank = MoEBank(StackedMLP(8, 6, [1]), DSelectK(4, 2, num_gates=4), 2)
    x = torch.randn(5, 6)
    with pytest.raises(ValueError, match=r"weights must have shape \(2, 2, 4\) or \(4, 4\)"):
        bank(x, torch.rand(3, 3, 3))
    w = torch.softmax(torch.randn(4, 4), -1)
    assert torch.equal(bank(x, w).outputs, bank(x, w.view(2, 2, 4)).outputs)


@pytest.mark.parametrize("value", ["1", b"1", True])
def test_a_gate_hyperparameter_is_a_number_not_text_or_a_flag(value: object) -> None:
    """``float("1")`` and ``float(True)`` would succeed: text and flags are refused, in the
    constructor and by assignment, naming the hyperparameter."""
    from dselectk.gates import DSelectK

    with pytest.raises(TypeError, match="gamma must be a number"):
        DSelectK(4, 2, gamma=value)  # type: ignore[arg-type]
    gate = DSelectK(4, 2)
    with pytest.raises(TypeError, match="entropy_reg must be a number"):
        gate.entropy_reg = value  # type: ignore[assignment]
    assert float(gate.entropy_reg) == 0.0
