"""The top level is small, every name of it is shown in an example CI runs
(tests/test_docs_examples.py runs them), and what left it is still importable from its
submodule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import dselectk

ROOT = Path(__file__).resolve().parents[1]


def _example_code() -> dict[str, str]:
    """The code CI runs as examples: README.md's and docs/**/*.md's ```python blocks and
    examples/*.py."""
    out: dict[str, str] = {}
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]:
        if md.is_file():
            blocks = re.findall(r"```python\n(.*?)```", md.read_text(encoding="utf-8"), re.S)
            out[str(md.relative_to(ROOT))] = "\n".join(blocks)
    for py in sorted((ROOT / "examples").glob("*.py")):
        out[str(py.relative_to(ROOT))] = py.read_text(encoding="utf-8")
    return out


def test_the_top_level_is_small() -> None:
    assert 12 <= len(dselectk.__all__) <= 16, dselectk.__all__
    assert set(dselectk.__all__) == {
        "DSelectK", "TopKGate", "SoftmaxGate", "COMETGate", "GumbelSoftmaxGate", "make_gate",
        "MoE", "MultiGateMoE", "SparseMoEFeedForward", "MoEBank",
        "train", "TrainConfig", "TaskData", "SwapSearch",
    }  # fmt: skip


@pytest.mark.parametrize("name", sorted(dselectk.__all__))
def test_each_top_level_name_is_in_an_example(name: str) -> None:
    hits = [f for f, code in _example_code().items() if re.search(rf"\b{name}\b", code)]
    assert hits, f"dselectk.{name} appears in no README/docs python block or examples/*.py"


def test_what_left_the_top_level_lives_in_its_submodule() -> None:
    from dselectk.gates import Gate, GateOutput, SoftmaxSelectorGate, gate_names
    from dselectk.layers import ExpertList, StackedMLP, make_towers
    from dselectk.models import MoEOutput, MultiTaskOutput, SharedBottom

    for obj in (Gate, GateOutput, SoftmaxSelectorGate, gate_names, ExpertList, StackedMLP,
                make_towers, MoEOutput, MultiTaskOutput, SharedBottom):  # fmt: skip
        assert obj.__name__ not in dselectk.__all__
    with pytest.raises(AttributeError):
        dselectk.SoftmaxSelectorGate  # noqa: B018 - an ablation gate is not top-level API


def test_a_bank_returns_named_fields() -> None:
    import torch

    from dselectk.gates import DSelectK
    from dselectk.layers import StackedMLP
    from dselectk.models import BankOutput, MoEBank

    bank = MoEBank(
        StackedMLP(2 * 4, 3, [2, 1], final_activation=False), DSelectK(4, 2, num_gates=6), 2
    )
    out = bank(torch.randn(5, 3))
    assert isinstance(out, BankOutput) and out.outputs.shape == (2, 3, 5)
    pred, aux = out  # still a pair
    assert pred is out.outputs and aux is out.aux_loss and aux.dim() == 0
