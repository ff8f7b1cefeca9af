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
