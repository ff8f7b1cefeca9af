"""DSelect-k collapse remedies (issue 14, research/notes/collapse.md) after issue 21.

The remedies the evidence retired (exclusive selectors, the α floor, ``init="distinct"`` and its
``init_margin``) are gone from the gate, with their second math path; they live at the commit
``a78ed56``. What stays: the paper's init, ``init="spread"`` and the diversity
penalty μ (tested with the gate in test_gates*.py).
"""

from __future__ import annotations

import pytest

import dselectk.gates.dselect_k as dk_module
from dselectk.gates import DSelectK


def test_retired_init_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match=r"init must be one of \('paper', 'spread'\)"):
        DSelectK(8, 2, init="distinct")


@pytest.mark.parametrize(
    "option", [{"exclusive": True}, {"alpha_floor": 0.5}, {"init_margin": 0.25}]
)
def test_retired_options_are_gone(option: dict[str, object]) -> None:
    with pytest.raises(TypeError, match=next(iter(option))):
        DSelectK(8, 2, **option)  # type: ignore[arg-type]


def test_one_math_path() -> None:
    assert not hasattr(dk_module, "exclusive_selectors")
    assert not hasattr(DSelectK, "_gate_composed")
    gate = DSelectK(8, 2, init="spread")
    assert "exclusive" not in repr(gate) and "alpha_floor" not in repr(gate)
