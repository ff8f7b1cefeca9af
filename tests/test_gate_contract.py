"""The gate answers for itself (issue 21): every registered gate keeps the Gate contract
(binarity, selection, diagnostics, inference weights, freezing), and no module outside
``dselectk.gates`` switches on a concrete gate class."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

import dselectk.gates
from dselectk.gates.base import Gate
from dselectk.gates.fixed import FixedGate
from dselectk.gates.registry import gate_names, gate_spec, make_gate

PKG = Path(__file__).resolve().parents[1] / "src" / "dselectk"
N, K, P, T = 8, 3, 5, 3
LAYOUTS = [(None, None), (None, T), (P, None), (P, T)]  # (in_features, num_gates)


def _concrete_gate_classes() -> set[str]:
    """Names of every Gate subclass defined in dselectk.gates (DSelectK, TopKGate, ...)."""
    assert dselectk.gates.__name__  # the package is imported: its classes are registered
    out: set[str] = set()
    todo = list(Gate.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("dselectk.gates."):
            out.add(cls.__name__)
    return out


def _names(node: ast.expr) -> list[str]:
    """The class names an isinstance/issubclass second argument mentions."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Tuple):
        return [n for elt in node.elts for n in _names(elt)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # A | B
        return _names(node.left) + _names(node.right)
    return []


def test_no_switch_on_a_concrete_gate_class_outside_gates() -> None:
    concrete = _concrete_gate_classes()
    assert {"DSelectK", "TopKGate", "COMETGate", "FixedGate", "SoftmaxGate"} <= concrete
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        if (PKG / "gates") in path.parents:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
            ):
                hit = sorted(set(_names(node.args[1])) & concrete)
                if hit:
                    rel = path.relative_to(PKG.parent)
                    offenders.append(f"{rel}:{node.lineno} {node.func.id}(..., {', '.join(hit)})")
    assert not offenders, "ask the gate (Gate methods) instead of switching on its class:\n" + (
        "\n".join(offenders)
    )


def _build(name: str, in_features: int | None, num_gates: int | None) -> Gate:
    kw: dict[str, Any] = {"in_features": in_features, "num_gates": num_gates}
    if gate_spec(name).takes_k:
        kw["k"] = K
    torch.manual_seed(0)
    return make_gate(name, N, **kw).eval()


def _input(gate: Gate) -> torch.Tensor | None:
    return None if gate.static else torch.randn(6, P)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", gate_names())
def test_is_binary_shape_and_dtype(name: str, layout: tuple[Any, Any]) -> None:
    gate = _build(name, *layout)
    x = _input(gate)
    lead = () if gate.num_gates is None else (gate.num_gates,)
    b = gate.is_binary(x)
    assert tuple(b.shape) == lead
    if gate.static:
        assert b.dtype == torch.bool
    else:
        assert b.is_floating_point() and bool(((b >= 0) & (b <= 1)).all())
        tokens = gate.is_binary(torch.randn(2, 3, P))  # tokens (B, S, p) are examples
        assert tuple(tokens.shape) == lead
        with pytest.raises(ValueError, match="per-example"):
            gate.is_binary(None)
    if gate.binarizes:
        entries = gate.binary_entries(x)
        assert entries.dtype == torch.bool
        direct = entries.all(-1)
        want = direct if gate.static else direct.float().mean(0)
        assert torch.equal(b, want)
    else:
        with pytest.raises(NotImplementedError, match="binarizes"):
            gate.binary_entries(x)


@pytest.mark.parametrize("name", gate_names())
def test_binary_answers_are_honest(name: str) -> None:
    """Top-k and Gumbel: final by construction; softmax and the ablations: never; the
    binarizing gates: False at init (every S strictly inside (0, 1)), True once saturated."""
    gate = _build(name, None, T)
    if gate.binarizes:
        assert not bool(gate.is_binary().any())
        with torch.no_grad():
            gate.logits.mul_(1e6)
        assert bool(gate.is_binary().all())
    elif name in ("topk", "gumbel_softmax"):
        assert bool(gate.is_binary().all())
    else:
        assert not bool(gate.is_binary().any())
    assert bool(FixedGate(torch.eye(3)[:2], bank=True).is_binary().all())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", gate_names())
def test_diagnostics_inference_weights_and_freeze_blocker(
    name: str, layout: tuple[Any, Any]
) -> None:
    gate = _build(name, *layout)
    x = _input(gate)
    g = gate.num_gates or 1
    diag = gate.diagnostics(x)
    assert isinstance(diag, dict)
    for key, val in diag.items():
        assert isinstance(key, str) and isinstance(val, torch.Tensor)
        assert val.shape[0] == g, key
        assert bool(torch.isfinite(val).all()), key
    if gate.binarizes:
        assert {"binary", "binary_fraction"} <= set(diag)
    if not gate.static:
        tokens = gate.diagnostics(torch.randn(2, 3, P))
        assert set(tokens) == set(diag)
    w = gate.inference_weights(x)
    assert w.shape == gate(x).weights.shape
    if not gate.posthoc_inference:
        torch.testing.assert_close(w, gate.expert_weights(x), rtol=0, atol=0)
    if gate.static:
        reason = gate.freeze_blocker(gate(None).weights.detach())
        assert reason is None or isinstance(reason, str)


@pytest.mark.parametrize("num_gates", [None, T])
@pytest.mark.parametrize("name", gate_names())
def test_selection_round_trip(name: str, num_gates: int | None) -> None:
    gate = _build(name, None, num_gates)
    shape = (K,) if num_gates is None else (num_gates, K)
    if not gate.searchable:
        with pytest.raises(NotImplementedError, match="searchable"):
            gate.selection()
        with pytest.raises(NotImplementedError, match="searchable"):
            gate.set_selection(torch.zeros(shape, dtype=torch.long))
        return
    sel = gate.selection()
    assert sel.dtype == torch.long and tuple(sel.shape) == shape
    assert gate.selection_is_final().shape == sel.shape
    g = torch.Generator().manual_seed(1)
    want = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(num_gates or 1)])
    want = want.reshape(shape)
    gate.set_selection(want)
    # DSelect-k: selector i is on want[..., i]; Top-k: want[..., i] holds rank i
    assert torch.equal(gate.selection(), want)
    assert bool(gate.selection_is_final().all())
    assert bool(gate.is_binary().all())
    chosen = torch.zeros(*shape[:-1], N, dtype=torch.bool).scatter(-1, want, True)
    assert torch.equal(gate.selected_experts(), chosen)  # nonzero exactly on the chosen
    sw = gate.selector_weights()
    assert tuple(sw.shape) == (*shape, N)
    assert torch.equal(sw.argmax(-1), want)
    # -1 keeps a selector; a one-selector move changes only that selector
    move = torch.full(shape, -1, dtype=torch.long)
    free = next(e for e in range(N) if e not in want.reshape(-1, K)[0].tolist())
    move.reshape(-1, K)[0, 1] = free
    gate.set_selection(move)
    after = gate.selection().reshape(-1, K)
    assert int(after[0, 1]) == free
    assert torch.equal(after[1:], want.reshape(-1, K)[1:])
    assert after[0, 0] == want.reshape(-1, K)[0, 0] and after[0, 2] == want.reshape(-1, K)[0, 2]


@pytest.mark.parametrize("name", [n for n in gate_names() if _build(n, None, None).searchable])
def test_set_selection_rejects_bad_input(name: str) -> None:
    gate = _build(name, None, T)
    with pytest.raises(TypeError, match="experts"):
        gate.set_selection(torch.zeros(T, K))
    with pytest.raises(ValueError, match="experts must have shape"):
        gate.set_selection(torch.zeros(K, dtype=torch.long))
    with pytest.raises(ValueError, match="experts must hold"):
        gate.set_selection(torch.full((T, K), N, dtype=torch.long))
    if not gate.binarizes:  # Top-k selects a set: duplicates are refused
        with pytest.raises(ValueError, match="experts"):
            gate.set_selection(torch.zeros(T, K, dtype=torch.long))
    per_example = _build(name, P, None)
    with pytest.raises(ValueError, match="per-example"):
        per_example.selection()
