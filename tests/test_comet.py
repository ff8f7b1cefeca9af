"""COMET's tree gate: the tree arithmetic against brute force, exact sparsity, the entropy."""

from __future__ import annotations

import math

import pytest
import torch

import dselectk as dk
from dselectk.gates import gate_names
from dselectk.gates.comet import COMETGate, tree_leaf_probabilities


def _path_product(split: torch.Tensor, n: int) -> torch.Tensor:
    """Leaf probabilities by walking from each leaf up to the root (heap order)."""
    out = []
    for leaf in range(n - 1, 2 * n - 1):
        prob, node = torch.ones(split.shape[:-1], dtype=split.dtype), leaf
        while node:
            parent = (node - 1) // 2
            left = node == 2 * parent + 1
            prob = prob * (split[..., parent] if left else 1 - split[..., parent])
            node = parent
        out.append(prob)
    return torch.stack(out, -1)


@pytest.mark.parametrize("n", range(2, 12))
def test_leaf_probabilities_are_the_path_products(n: int) -> None:
    split = torch.rand(4, 3, n - 1, dtype=torch.float64)
    p, reach = tree_leaf_probabilities(split, n)
    torch.testing.assert_close(p, _path_product(split, n))
    torch.testing.assert_close(p.sum(-1), torch.ones(4, 3, dtype=torch.float64))
    # the mass reaching internal node q is the sum of its two children's
    children = torch.cat([reach, p], -1)  # heap order: nodes 0 … 2n − 2
    for q in range(n - 1):
        torch.testing.assert_close(
            reach[..., q], children[..., 2 * q + 1] + children[..., 2 * q + 2]
        )


def test_weights_are_a_softmax_over_tree_leaf_pairs_and_entropy_is_the_leaf_entropy() -> None:
    torch.manual_seed(0)
    n, k, lam = 6, 3, 0.7
    gate = COMETGate(n, k, gamma=2.0, entropy_reg=lam).double()
    with torch.no_grad():
        gate.logits.uniform_(-0.8, 0.8)
    u, a = gate.split_logits(gate.logits)
    p, _ = tree_leaf_probabilities(dk.functional.smooth_step(u, 2.0), n)
    g = torch.softmax((a + p.log()).flatten(), 0).view(k, n)
    out = gate()
    torch.testing.assert_close(out.weights, g.sum(0))
    torch.testing.assert_close(out.aux_loss, lam * -(p * p.log()).sum())
    assert sum(q.numel() for q in gate.parameters()) == k * (2 * n - 1)


@pytest.mark.parametrize("n", [4, 5, 16])
def test_binary_splits_select_at_most_k_experts_with_zero_entropy(n: int) -> None:
    torch.manual_seed(1)
    k = 3
    gate = COMETGate(n, k, gamma=1.0, entropy_reg=1.0, in_features=7, num_gates=2)
    with torch.no_grad():
        gate.proj.weight.mul_(1e7)  # |u| >= γ/2 everywhere: binary splits
        gate.proj.bias.mul_(1e7)
    x = torch.randn(50, 7)
    out = gate(x)
    assert bool(((gate.splits(x) == 0) | (gate.splits(x) == 1)).all())
    assert int((out.weights > 0).sum(-1).max()) <= k
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(50, 2))
    assert float(out.aux_loss.detach()) == 0.0
    # exactly one leaf per tree: the weights are a softmax of the reached leaves' scores
    u, _scores = gate.split_logits(gate.compute_logits(x))
    p, _ = tree_leaf_probabilities(dk.functional.smooth_step(u, 1.0), n)
    assert bool((p.sum(-1) == 1).all()) and bool(((p == 0) | (p == 1)).all())


def test_per_gate_gamma_bank_equals_single_gates() -> None:
    torch.manual_seed(2)
    bank = COMETGate(5, 2, gamma=[0.5, 3.0], entropy_reg=[0.1, 0.0], num_gates=2)
    for t, (g, lam) in enumerate([(0.5, 0.1), (3.0, 0.0)]):
        single = COMETGate(5, 2, gamma=g, entropy_reg=lam)
        with torch.no_grad():
            single.logits.copy_(bank.logits[t])
        torch.testing.assert_close(bank().weights[t], single().weights)
    per_gate = [COMETGate(5, 2, gamma=g, entropy_reg=lam) for g, lam in [(0.5, 0.1), (3.0, 0.0)]]
    for t, single in enumerate(per_gate):
        with torch.no_grad():
            single.logits.copy_(bank.logits[t])
    torch.testing.assert_close(bank().aux_loss, sum(s().aux_loss for s in per_gate))


def test_init_and_errors() -> None:
    gate = COMETGate(8, 2, gamma=10.0)
    u, a = gate.split_logits(gate.logits.detach())
    assert float(u.abs().max()) <= 0.1 and float(a.abs().max()) <= 0.05
    assert bool(((gate.splits() > 0) & (gate.splits() < 1)).all())
    with pytest.raises(ValueError, match="k must be <= num_experts"):
        COMETGate(4, 5)
    with pytest.raises(ValueError, match="gamma"):
        COMETGate(4, 2, gamma=0.0)
    with pytest.raises(ValueError, match="internal nodes"):
        tree_leaf_probabilities(torch.rand(3), 5)
    assert "comet" in gate_names()
    assert math.isclose(float(dk.make_gate("comet", 4, k=1)().weights.sum()), 1.0, rel_tol=1e-6)
