"""DSelect-k collapse remedies (issue 14, research/notes/collapse.md) after issue 21.

The remedies the evidence retired (exclusive selectors, the α floor, ``init="distinct"`` and its
``init_margin``) are gone from the gate, with their second math path; they live at the commit
``a78ed56``. What stays: the paper's init in ``DSelectK``; ``init="spread"`` and the
diversity penalty μ, which measured no gain either, in ``DSelectKExtended`` (tested with the
gate in test_gates*.py).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import dselectk.gates.dselect_k as dk_module
from dselectk.gates import DSelectK, DSelectKExtended, gate_spec, make_gate


def test_retired_init_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match=r"init must be one of \('paper', 'spread'\)"):
        DSelectKExtended(8, 2, init="distinct")


@pytest.mark.parametrize(
    "option", [{"exclusive": True}, {"alpha_floor": 0.5}, {"init_margin": 0.25}]
)
def test_retired_options_are_gone(option: dict[str, object]) -> None:
    with pytest.raises(TypeError, match=next(iter(option))):
        DSelectK(8, 2, **option)  # type: ignore[arg-type]


def test_one_math_path() -> None:
    assert not hasattr(dk_module, "exclusive_selectors")
    assert not hasattr(DSelectK, "_gate_composed")
    gate = DSelectKExtended(8, 2, init="spread")
    assert "exclusive" not in repr(gate) and "alpha_floor" not in repr(gate)


# -- the research options live in DSelectKExtended ----------------------------------------------


@pytest.mark.parametrize("option", [{"diversity": 0.1}, {"init": "spread"}, {"init": "paper"}])
def test_dselect_k_refuses_the_research_options_naming_the_extended_gate(
    option: dict[str, object],
) -> None:
    with pytest.raises(TypeError, match=rf"no argument '{next(iter(option))}'.*DSelectKExtended"):
        DSelectK(8, 2, **option)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="DSelectKExtended"):
        make_gate("dselect_k", 8, k=2, **option)
    gate = DSelectK(8, 2)
    with pytest.raises(AttributeError, match="DSelectKExtended"):
        setattr(gate, next(iter(option)), 0.5)  # not stored where nothing reads it
    with pytest.raises(AttributeError, match="DSelectKExtended"):
        getattr(gate, next(iter(option)))
    assert sorted(gate_spec("dselect_k").hparams) == ["distinct", "entropy_reg", "gamma", "xi"]


@pytest.mark.parametrize("layout", [(None, None), (None, 3), (5, None), (5, 3)])
def test_extended_gate_at_its_defaults_is_dselect_k(layout: tuple[int | None, int | None]) -> None:
    in_features, num_gates = layout
    kw: dict[str, Any] = {"in_features": in_features, "num_gates": num_gates, "gamma": 2.0}
    torch.manual_seed(0)
    plain = DSelectK(8, 2, entropy_reg=0.1, **kw)
    torch.manual_seed(0)
    ext = make_gate("dselect_k_extended", 8, k=2, entropy_reg=0.1, **kw)
    assert type(ext) is DSelectKExtended and isinstance(ext, DSelectK)
    assert ext.init == "paper" and float(ext.diversity) == 0.0
    for (name, a), (_, b) in zip(plain.named_parameters(), ext.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    x = None if in_features is None else torch.randn(4, in_features)
    for a, b in zip(plain(x), ext(x), strict=True):
        assert torch.equal(a, b)
    assert ext.extra_repr() == plain.extra_repr() + ", init='paper'"


def test_old_dselect_k_states_with_a_diversity_buffer_load() -> None:
    # a state saved when DSelectK held the diversity option: its buffer _diversity, at 0
    torch.manual_seed(0)
    saved = DSelectKExtended(8, 2, in_features=5, num_gates=2, gamma=[1.0, 2.0])
    state = saved.state_dict()
    assert "_diversity" in state and float(state["_diversity"]) == 0.0
    fresh = DSelectK(8, 2, in_features=5, num_gates=2)
    result = fresh.load_state_dict(state)  # strict
    assert not result.missing_keys and not result.unexpected_keys
    assert "_diversity" not in fresh.state_dict() and fresh.gamma.tolist() == [1.0, 2.0]
    x = torch.randn(3, 5)
    for a, b in zip(fresh(x), saved(x), strict=True):
        assert torch.equal(a, b)
    # nested in a model and through a file, as a checkpoint holds it
    buf = io.BytesIO()
    torch.save(torch.nn.Sequential(saved).state_dict(), buf)
    buf.seek(0)
    model = torch.nn.Sequential(DSelectK(8, 2, in_features=5, num_gates=2))
    model.load_state_dict(torch.load(buf))
    assert torch.equal(model(x).weights, saved(x).weights)
    # one with a nonzero μ would train another loss: refused, naming where it loads
    saved.diversity = [0.0, 0.3]
    with pytest.raises(RuntimeError, match=r"μ = \[0, 0\.3\].*DSelectKExtended"):
        DSelectK(8, 2, in_features=5, num_gates=2).load_state_dict(saved.state_dict())
    with pytest.raises(RuntimeError, match="DSelectKExtended"):
        DSelectK(8, 2, in_features=5, num_gates=2).load_state_dict(saved.state_dict(), strict=False)
    again = DSelectKExtended(8, 2, in_features=5, num_gates=2)
    again.load_state_dict(saved.state_dict())
    assert again.diversity.tolist() == pytest.approx([0.0, 0.3])
