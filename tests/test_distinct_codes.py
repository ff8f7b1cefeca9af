"""``DSelectK(distinct=True)`` and :func:`dselectk.functional.distinct_codes` (issue 23): the
K selectors of every gate (per example: of every input) have distinct expert codes, reached by
negating the fewest, least confident bits; binary gates select exactly k distinct experts."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import Tensor

from dselectk import MoE, StackedMLP
from dselectk import functional as DF
from dselectk.export import export_program, to_onnx
from dselectk.gates import make_gate
from dselectk.layers import SparseMoEFeedForward

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
    moe = SparseMoEFeedForward(6, 12, 8, gate, k=2, balance_loss_weight=0.0)
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
    model = MoE(StackedMLP(8, 6, [5]), g, conditional=True).eval()
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


# -- distinct_binary: only binary selectors take part -------------------------------------------


def _binary_only_reference(z: Tensor, n: int, gamma: float) -> Tensor:
    """The binary-only rule per selector: a selector with a soft bit (|z| < γ/2) is kept and
    holds nothing; a binary one keeps its code if no earlier binary selector holds it and it
    is < n, else takes the free code with the least Σ|z| over the bits that differ."""
    k, m = z.shape
    out = z.clone()
    taken: set[int] = set()
    for i in range(k):
        if not bool((2 * z[i].abs() >= gamma).all()):
            continue
        own = [int(b) for b in (z[i] > 0)]
        best, best_cost = -1, float("inf")
        for c in range(2**m):
            if c >= n or c in taken:
                continue
            cost = sum(float(z[i, j].abs()) for j in range(m) if ((c >> j) & 1) != own[j])
            if cost < best_cost:
                best, best_cost = c, cost
        taken.add(best)
        for j in range(m):
            if ((best >> j) & 1) != own[j]:
                out[i, j] = -z[i, j]
    return out


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_binary_only_codes_match_the_rule(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 17 + k)
    m, gamma = DF.num_bits(n), 1.0
    z = torch.randn(96, k, m, generator=gen, dtype=torch.float64)
    z[:32, 1:] = z[:32, :1]  # collisions
    z[::3] = z[::3].sign() * (z[::3].abs() + 0.5)  # every third gate: all selectors binary
    out = DF.distinct_codes(z, n, torch.tensor(gamma, dtype=torch.float64))
    assert torch.equal(out.abs(), z.abs())
    for b in range(z.shape[0]):
        torch.testing.assert_close(out[b], _binary_only_reference(z[b], n, gamma), rtol=0, atol=0)
    binary = (2 * z.abs() >= gamma).all(-1)  # (B, K)
    assert torch.equal(out[~binary], z[~binary])  # soft selectors are never moved
    full = binary.all(-1)  # gates whose selectors are all binary: the plain rule
    assert full.sum() >= 32
    assert torch.equal(out[full], DF.distinct_codes(z[full], n))
    codes = _codes(out)
    for row, bin_row in zip(codes.tolist(), binary.tolist()):
        held = [c for c, b in zip(row, bin_row) if b]
        assert len(set(held)) == len(held) and all(c < n for c in held)


def test_binary_only_reads_a_per_gate_gamma() -> None:
    z = torch.tensor([[[0.6, 0.6], [0.6, 0.6]], [[0.6, 0.6], [0.6, 0.6]]])  # (T, K, M), collide
    gamma = torch.tensor([1.0, 2.0]).view(2, 1, 1)  # gate 0 binary (|z| >= 1/2), gate 1 soft
    out = DF.distinct_codes(z, 4, gamma)
    assert _codes(out[0]).unique().numel() == 2
    assert torch.equal(out[1], z[1])


def _gate_pair(scale: float, **kw: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    gates = []
    for binary_only in (True, False):
        torch.manual_seed(3)
        g = make_gate("dselect_k", 8, k=2, in_features=6, distinct_binary=binary_only, **kw)
        with torch.no_grad():
            g.proj.weight[2:].normal_(0, scale)
        gates.append(g)
    return gates[0], gates[1]


def test_binary_only_gate_is_the_paper_gate_unless_binary_selectors_collide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DSELECTK_KERNEL", "aten")  # the paper gate on the same kernel: exact
    g, paper = _gate_pair(2.0)
    x = torch.randn(2048, 6)
    _, z = paper.split_logits(paper.compute_logits(x))
    binary = (2 * z.abs() >= 1.0).all(-1)  # (B, K) at γ = 1
    hit = binary.all(-1) & (_codes(z)[:, 0] == _codes(z)[:, 1])
    assert hit.sum() > 20 and (~hit).sum() > 1000
    torch.testing.assert_close(g(x).weights[~hit], paper(x).weights[~hit], rtol=0, atol=0)
    w = g(x).weights[hit]
    assert ((w > 0).sum(-1) == 2).all()  # two experts where the paper gate has one
    assert ((paper(x).weights[hit] > 0).sum(-1) == 1).all()


def test_binary_only_gate_selects_k_distinct_experts_once_binary() -> None:
    g, _ = _gate_pair(50.0)
    x = torch.randn(1024, 6)
    x = x[g.binary_entries(x).all(-1)]
    assert len(x) > 512
    assert ((g(x).weights > 0).sum(-1) == 2).all()


def test_binary_only_gradcheck() -> None:
    # n = 8: no unused codes (a selector parked on one makes the Appendix B.2 penalty ξ/eps,
    # ~4.5e15 in float64, and finite differences of the sum lose every other term's change)
    torch.manual_seed(5)
    g = make_gate("dselect_k", 8, k=3, in_features=4, distinct_binary=True, entropy_reg=0.1)
    g = g.double()
    with torch.no_grad():  # some selectors binary (and colliding), some soft, none at a kink
        g.proj.weight.normal_(0, 1.0)
    x = torch.randn(9, 4, dtype=torch.float64)
    _, z = g.split_logits(g.compute_logits(x))
    keep = ((2 * z.abs() - 1.0).abs() > 0.05).all(-1).all(-1)  # off the saturation kinks
    x = x[keep].requires_grad_(True)
    assert len(x) >= 3
    assert torch.autograd.gradcheck(lambda x: g(x).weights, (x,))
    assert torch.autograd.gradcheck(lambda x: g(x).aux_loss, (x,))


def test_binary_only_is_declared_and_exclusive() -> None:
    with pytest.raises(ValueError, match="distinct_binary"):
        make_gate("dselect_k", 8, k=2, distinct_binary="yes")
    with pytest.raises(ValueError, match="choose one"):
        make_gate("dselect_k", 8, k=2, distinct=True, distinct_binary=True)
    assert "distinct_binary=True" in repr(make_gate("dselect_k", 8, k=2, distinct_binary=True))


@pytest.mark.parametrize("onnx", [False, True])
def test_binary_only_export_equals_eager(tmp_path: Path, onnx: bool) -> None:
    torch.manual_seed(0)
    g = make_gate("dselect_k", 8, k=3, in_features=6, distinct_binary=True)
    with torch.no_grad():
        g.proj.weight.mul_(300.0)  # a mix of binary and soft selectors
    model = MoE(StackedMLP(8, 6, [5]), g, conditional=True).eval()
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
