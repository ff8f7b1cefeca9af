"""``DSelectK(distinct=True)`` and :func:`dselectk.functional.distinct_codes` (issue 23): the
K selectors of every gate (per example: of every input) have distinct expert codes, reached by
negating the fewest, least confident bits; binary gates select exactly k distinct experts."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import Tensor

from dselectk import MoE
from dselectk import functional as DF
from dselectk.export import export_program, to_onnx
from dselectk.gates import make_gate
from dselectk.layers import SparseMoEFeedForward, StackedMLP

SHAPES = [(2, 2), (4, 2), (5, 3), (8, 2), (8, 4), (6, 6), (16, 3), (3, 3)]


def _codes(z: Tensor) -> Tensor:
    place = 2 ** torch.arange(z.shape[-1])
    return ((z > 0).long() * place).sum(-1)


def _greedy_reference(z: Tensor, n: int) -> Tensor:
    """The rule written out per selector: keep the code if free and < n, else the free code
    with the least Σ|z| over the bits that differ (ties: smallest code)."""
    k, m = z.shape
    out = z.clone()
    taken: set[int] = set()
    for i in range(k):
        own = [int(b) for b in (z[i] > 0)]
        best, best_cost = -1, float("inf")
        for c in range(2**m):
            if c >= n or c in taken:
                continue
            bits = [(c >> j) & 1 for j in range(m)]
            cost = sum(float(z[i, j].abs()) for j in range(m) if bits[j] != own[j])
            if cost < best_cost:
                best, best_cost = c, cost
        taken.add(best)
        for j in range(m):
            if ((best >> j) & 1) != own[j]:
                out[i, j] = -z[i, j]
    return out


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_codes_are_distinct_experts_and_match_the_rule(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 31 + k)
    m = DF.num_bits(n)
    z = torch.randn(64, k, m, generator=gen, dtype=torch.float64)
    z[:16, 1:] = z[:16, :1]  # every selector on selector 0's code: worst-case collisions
    out = DF.distinct_codes(z, n)
    codes = _codes(out)
    assert (codes < n).all()
    for row in codes.tolist():
        assert len(set(row)) == k
    assert torch.equal(out.abs(), z.abs())  # only signs change
    for b in range(z.shape[0]):
        torch.testing.assert_close(out[b], _greedy_reference(z[b], n), rtol=0, atol=0)


def test_distinct_valid_codes_are_left_alone() -> None:
    z = torch.tensor([[[1.0, -2.0, 0.5], [-1.0, 2.0, 0.5], [0.3, 0.3, -0.3]]])  # codes 5, 6, 3
    assert torch.equal(DF.distinct_codes(z, 8), z)


def test_leading_shapes_bank_and_per_example() -> None:
    z = torch.randn(5, 3, 2, 3)  # (B, T, K, M)
    out = DF.distinct_codes(z, 8)
    flat = DF.distinct_codes(z.reshape(15, 2, 3), 8).reshape(z.shape)
    assert torch.equal(out, flat)


def test_more_selectors_than_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="K <= n"):
        DF.distinct_codes(torch.randn(3, 2), 2)


def _binary_gate(n: int, k: int, distinct: bool, scale: float = 50.0) -> torch.nn.Module:
    torch.manual_seed(0)
    g = make_gate("dselect_k", n, k=k, in_features=6, distinct=distinct)
    with torch.no_grad():
        g.proj.weight[k:].normal_(0, scale)  # the Z rows: |Wx| >> γ, bits binary; α rows kept
    return g


@pytest.mark.parametrize(("n", "k"), [(8, 2), (5, 3), (16, 4), (3, 3)])
def test_binary_gate_selects_exactly_k_distinct_experts_for_every_input(n: int, k: int) -> None:
    g = _binary_gate(n, k, distinct=True)
    x = torch.randn(1024, 6)
    x = x[g.binary_entries(x).all(-1)]  # the inputs whose bits are all binary
    assert len(x) > 512
    w = g(x).weights
    assert ((w > 0).sum(-1) == k).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(len(x)))
    paper = _binary_gate(n, k, distinct=False)
    assert ((paper(x).weights > 0).sum(-1) < k).any()  # the paper's gate collides here


def test_same_weights_as_the_paper_gate_when_no_selector_collides() -> None:
    g, paper = _binary_gate(8, 2, True, scale=0.3), _binary_gate(8, 2, False, scale=0.3)
    x = torch.randn(256, 6)
    _, z = paper.split_logits(paper.compute_logits(x))
    free = _codes(z)[:, 0] != _codes(z)[:, 1]
    assert free.any() and (~free).any()
    torch.testing.assert_close(g(x).weights[free], paper(x).weights[free])
    assert not torch.allclose(g(x).weights[~free], paper(x).weights[~free])


def test_gradcheck_per_example_and_static() -> None:
    g = make_gate("dselect_k", 5, k=3, in_features=4, distinct=True, entropy_reg=0.1).double()
    with torch.no_grad():
        g.proj.weight.normal_(0, 0.3)
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: g(x).weights, (x,))
    assert torch.autograd.gradcheck(lambda x: g(x).aux_loss, (x,))
    s = make_gate("dselect_k", 6, k=2, distinct=True, num_gates=3).double()
    with torch.no_grad():
        s.logits.normal_(0, 0.3)
    logits = s.logits.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: s.gate(t).weights, (logits,))


def test_no_jump_when_a_selector_walks_into_another_code() -> None:
    """Selector 1 crosses into selector 0's code through its least confident bit: the weights
    are continuous across the crossing (the bit is negated at 0, where S is 1/2 either way)."""
    g = make_gate("dselect_k", 8, k=2, distinct=True, gamma=1.0)
    alpha = torch.zeros(2)

    def weights(t: float) -> Tensor:
        z = torch.tensor([[0.8, -0.8, 0.8], [0.8, -0.8, t]])  # at t > 0: the same code
        return g.gate(torch.cat([alpha, z.flatten()])).weights

    for eps in (1e-3, 1e-5):
        torch.testing.assert_close(weights(eps), weights(-eps), atol=4 * eps, rtol=0)


def test_bits_and_diagnostics_see_the_moved_codes() -> None:
    g = _binary_gate(8, 2, True)
    x = torch.randn(400, 6)
    x = x[g.binary_entries(x).all(-1)][:256]
    assert float(g.diagnostics(x)["collisions"][0]) == 0.0
    assert float(_binary_gate(8, 2, False).diagnostics(x)["collisions"][0]) > 0.0
    p = g.bits(x)
    assert torch.equal(_codes(p - 0.5)[:, 0] != _codes(p - 0.5)[:, 1], torch.ones(256, dtype=bool))


def test_static_searchable_gate_reads_distinct_selection() -> None:
    g = make_gate("dselect_k", 8, k=3, distinct=True)
    g.set_selection(torch.tensor([5, 5, 5]))
    sel = g.selection()
    assert len(set(sel.tolist())) == 3 and sel[0] == 5


def test_token_moe_dispatches_k_distinct_experts_per_token() -> None:
    torch.manual_seed(0)
    gate = _binary_gate(8, 2, True)
    moe = SparseMoEFeedForward(6, 12, 8, gate, k=2, balance_weight=0.0)
    x = torch.randn(400, 6)
    x = x[gate.binary_entries(x).all(-1)][:120].reshape(3, 40, 6)
    out = moe(x).output
    assert moe.last_stats is not None and int(moe.last_stats["load"].sum()) == 2 * 120
    torch.testing.assert_close(out, moe.dense_reference(x), atol=1e-5, rtol=1e-5)


def test_registry_declares_distinct() -> None:
    with pytest.raises(ValueError, match="distinct"):
        make_gate("dselect_k", 8, k=2, distinct="yes")
    assert "distinct=True" in repr(make_gate("dselect_k", 8, k=2, distinct=True))
    assert "distinct" not in repr(make_gate("dselect_k", 8, k=2))


@pytest.mark.parametrize(("binary", "onnx"), list(itertools.product((True, False), (True, False))))
def test_export_equals_eager(tmp_path: Path, binary: bool, onnx: bool) -> None:
    torch.manual_seed(0)
    g = make_gate("dselect_k", 8, k=3, in_features=6, distinct=True)
    with torch.no_grad():
        g.proj.weight.mul_(1e4 if binary else 30.0)
    model = MoE(StackedMLP(8, 6, [5], final_activation=True), g, conditional=True).eval()
    if onnx:
        pytest.importorskip("onnxruntime")
        import onnxruntime as ort

        path = to_onnx(model, torch.randn(16, 6), tmp_path / "m.onnx", exporter="torchscript")
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

        def run(x: Tensor) -> Tensor:
            return torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    else:
        runner = export_program(model, torch.randn(16, 6)).module()

        def run(x: Tensor) -> Tensor:
            return runner(x)[0]

    for b in (16, 7, 1):
        x = torch.randn(b, 6)
        with torch.no_grad():
            torch.testing.assert_close(run(x), model(x).output, atol=1e-5, rtol=1e-5)
