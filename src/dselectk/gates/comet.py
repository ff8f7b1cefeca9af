"""COMET's tree gate (Ibrahim et al., KDD 2023, arXiv 2306.02824): k soft binary trees over the
experts, with smooth-step splits, so that each tree reaches exactly one leaf (one expert) once
its splits are binary.

Each of the k trees is a complete binary tree in heap order with n − 1 internal nodes and n
leaves (leaf j is expert j; for n a power of two all leaves are at depth log₂ n, otherwise at two
depths). Internal node q of tree i sends a fraction ``S(u_iq)`` of what reaches it to its left
child and the rest to its right child (S the cubic smooth-step of width γ, as in DSelect-k), so
tree i spreads a unit of mass over the leaves: ``P_ij`` = product of the splits on the path to
leaf j. Each leaf also has a score ``a_ij``; the gate's weights are

    w_j = Σ_i P_ij exp(a_ij) / Σ_{i,j'} P_ij' exp(a_ij'),

a softmax over the (tree, leaf) pairs restricted, through P, to the leaves the trees reach. Once
every split on a tree's path is binary the tree reaches one leaf, so at most k experts get a
nonzero weight. Static: u and a are parameters (k(n − 1) + kn per gate); per-example: an affine
function of the input (one fused linear layer), as for the other gates.

The auxiliary loss is λ Σ_i H(P_i·), the entropy of each tree's leaf distribution, computed by
the chain rule as Σ_q reach_q · h(S(u_q)) (reach_q the mass arriving at internal node q, h the
binary entropy): exactly 0 once the tree's splits along its path are binary. Per-example it is
averaged over the batch.

Differences from the authors' Keras layer (read for the math, not copied): leaves are numbered in
heap order (theirs follow the recursion's left-to-right order; a fixed relabelling of experts),
the entropy uses the chain rule instead of Σ −P log(P + 10⁻⁶) over the leaves (the same value
up to that ε), and the permutation matrix of their local search is not part of the gate (use
:mod:`dselectk.search` for local search).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dselectk import functional as DF
from dselectk.gates.base import (
    Gate,
    GateOutput,
    HyperParameter,
    format_hyperparameter,
)
from dselectk.gates.hyperparameter import GAMMA_MIN

__all__ = ["COMETGate", "tree_leaf_probabilities"]

#: half-width of the uniform initialisation of the leaf scores (Keras' RandomUniform default)
LEAF_INIT = 0.05


def tree_leaf_probabilities(split: Tensor, num_leaves: int) -> tuple[Tensor, Tensor]:
    """Leaf probabilities of complete binary trees in heap order.

    Args:
        split: (..., n − 1) the fraction going left at each internal node (heap order:
            node q's children are 2q + 1 and 2q + 2).
        num_leaves: n >= 2 (leaves are the heap nodes n − 1 … 2n − 2, leaf j = node n − 1 + j).

    Returns:
        (..., n) leaf probabilities (they sum to 1) and (..., n − 1) the mass reaching each
        internal node.

    Examples:
        One tree with 4 leaves: the root splits half/half, node 1 sends everything left, node
        2 everything right.

        >>> leaves, reach = tree_leaf_probabilities(torch.tensor([0.5, 1.0, 0.0]), 4)
        >>> leaves.tolist(), reach.tolist()
        ([0.5, 0.0, 0.0, 0.5], [1.0, 0.5, 0.5])
        >>> leaves, reach = tree_leaf_probabilities(torch.rand(4, 2, 5), 6)  # (batch, trees)
        >>> tuple(leaves.shape), tuple(reach.shape)
        ((4, 2, 6), (4, 2, 5))
    """
    internal = num_leaves - 1
    if split.shape[-1] != internal:
        raise ValueError(f"split must have {internal} internal nodes, got {split.shape[-1]}")
    # the root (heap index 0) gets mass 1, computed from the input so that a tracer records
    # ops on it (ones_like would be frozen into the graph as a constant of the example's shape)
    cur = split[..., :1] * 0.0 + 1.0
    start, leaves, reach = 0, [], []
    while True:
        n_int = max(0, min(start + cur.shape[-1], internal) - start)  # internal nodes here
        if n_int < cur.shape[-1]:
            leaves.append(cur[..., n_int:])  # leaves of this depth, heap order
        if n_int == 0:
            break
        mass, r = cur[..., :n_int], split[..., start : start + n_int]
        reach.append(mass)
        # children of nodes start … start + n_int − 1 are contiguous: left, right, left, ...
        cur = torch.stack((mass * r, mass * (1.0 - r)), dim=-1).flatten(-2)
        start = 2 * start + 1
    return torch.cat(leaves, dim=-1), torch.cat(reach, dim=-1)


class COMETGate(Gate):
    """COMET's tree gate: k soft binary trees with smooth-step splits (see the module docstring).

    Args:
        num_experts: n >= 2 (any n: complete trees).
        k: number of trees, 1 <= k <= n (at most k experts once the splits are binary).
        in_features: None (static) or input size p (per-example).
        gamma: smooth-step width γ > 0, or one per gate. Settable (schedules may anneal it).
        entropy_reg: λ >= 0 of the trees' leaf entropies, or one per gate. Settable.
        num_gates, bias: see :class:`~dselectk.gates.base.Gate`.

    Initialisation (the reference's): split logits U(±γ/100) (every split starts strictly
    inside (0, 1)), leaf scores U(±0.05); per-example, the layer's weights and biases.

    Binarity: the gate's selection is final once every tree reaches exactly one leaf (its leaf
    probabilities are all 0 or 1; :meth:`binary_entries`, :meth:`is_binary`).

    Examples:
        >>> from dselectk import COMETGate
        >>> gate = COMETGate(num_experts=6, k=2)  # static
        >>> w = gate.expert_weights()  # (the weights, without gradients)
        >>> tuple(w.shape), round(float(w.sum()), 4)
        ((6,), 1.0)
        >>> bool(gate.is_binary())  # the splits start strictly inside (0, 1)
        False
        >>> gate = COMETGate(6, k=2, in_features=16, num_gates=2)  # per-example, 2 tasks
        >>> tuple(gate(torch.randn(4, 16)).weights.shape)
        (4, 2, 6)
    """

    binarizes = True

    _gamma: Tensor
    gamma = HyperParameter(positive=True, minimum=GAMMA_MIN)
    _entropy_reg: Tensor
    entropy_reg = HyperParameter(positive=False)

    def __init__(
        self,
        num_experts: int,
        k: int,
        *,
        in_features: int | None = None,
        gamma: float | Sequence[float] | Tensor = 1.0,
        entropy_reg: float | Sequence[float] | Tensor = 0.0,
        num_gates: int | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_experts,
            in_features=in_features,
            num_gates=num_gates,
            bias=bias,
        )
        self._set_k(k)
        self.max_nonzeros = self.k  # once the splits are binary
        self.gamma = gamma
        self.entropy_reg = entropy_reg
        self._build_logits()
        self._init_parameters()

    def _logit_shape(self) -> tuple[int, ...]:
        return (self.k * (2 * self.num_experts - 1),)

    @torch.no_grad()
    def _init_parameters(self) -> None:
        """Split logits U(±γ/100) (one γ per gate: gate t's rows U(±γ_t/100)), leaf scores
        U(±0.05)."""
        g = 1 if self.num_gates is None else self.num_gates
        gamma = self.gamma
        bounds = gamma.tolist() if isinstance(gamma, Tensor) else [gamma] * g
        cut = self.k * (self.num_experts - 1)
        if self.static:
            rows = [self.logits.view(g, -1)]
        else:
            assert self.proj is not None
            rows = [self.proj.weight.view(g, self._logit_shape()[0], -1)]
            if self.proj.bias is not None:
                rows.append(self.proj.bias.view(g, -1))
        for t in rows:
            for row, b in zip(t, bounds):
                row[:cut].uniform_(-b / 100.0, b / 100.0)
                row[cut:].uniform_(-LEAF_INIT, LEAF_INIT)

    def split_logits(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Flat logits (..., k(2n − 1)) → split logits (..., k, n − 1), leaf scores (..., k, n)."""
        cut = self.k * (self.num_experts - 1)
        u = logits[..., :cut].unflatten(-1, (self.k, self.num_experts - 1))
        a = logits[..., cut:].unflatten(-1, (self.k, self.num_experts))
        return u, a

    def splits(self, x: Tensor | None = None) -> Tensor:
        """S(u): the split fractions, (*lead, k, n − 1)."""
        u, _ = self.split_logits(self.compute_logits(x))
        return DF.smooth_step(u, self._per_gate(self._gamma, 2))

    def gate(self, logits: Tensor) -> GateOutput:
        u, a = self.split_logits(logits)
        r = DF.smooth_step(u, self._per_gate(self._gamma, 2))  # (*lead, k, n − 1)
        p, reach = tree_leaf_probabilities(r, self.num_experts)  # (*lead, k, n), (*lead, k, n−1)
        # softmax over (tree, leaf) pairs weighted by P, shifted by the largest score among the
        # reached leaves (each tree reaches one at least): the reached terms stay in (0, 1]
        # even with huge scores; unreached ones (P = 0) are clamped so exp cannot overflow
        reached = a.detach().masked_fill(p <= 0, -torch.inf)
        top = reached.amax(dim=(-2, -1), keepdim=True)
        mass = p * torch.exp((a - top).clamp(max=0.0))
        weights = mass.sum(dim=-2) / mass.sum(dim=(-2, -1)).unsqueeze(-1)
        per_gate = self._per_gate(self._entropy_reg, 0) * (reach * DF.binary_entropy(r)).sum(
            dim=(-2, -1)
        )
        return GateOutput(weights, self._reduce_aux(per_gate))

    @torch.no_grad()
    def binary_entries(self, x: Tensor | None = None) -> Tensor:
        """Which leaf probabilities of the k trees are exactly 0 or 1: bool (*lead, k·n)."""
        leaves, _ = tree_leaf_probabilities(self.splits(x), self.num_experts)
        return ((leaves == 0) | (leaves == 1)).flatten(-2)

    @torch.no_grad()
    def diagnostics(self, x: Tensor | None = None) -> dict[str, Tensor]:
        """``binary_fraction`` (of the leaf probabilities that are exactly 0 or 1) and
        ``binary`` (every tree reaches one leaf: 1/0; per-example the fraction of the
        examples), each (G,); per-example, means over the examples (tokens) of ``x``."""
        entries = self.binary_entries(None if self.static else x)
        entries = entries.reshape(-1, self.num_gates or 1, entries.shape[-1])  # (N, T, k·n)
        return {
            "binary_fraction": entries.float().mean((0, 2)),
            "binary": entries.all(-1).float().mean(0),
        }

    def extra_repr(self) -> str:
        kind = "static" if self.static else f"in_features={self.in_features}"
        bank = "" if self.num_gates is None else f", num_gates={self.num_gates}"
        return (
            f"num_experts={self.num_experts}, k={self.k}, {kind}{bank}, "
            f"gamma={format_hyperparameter(self.gamma)}, "
            f"entropy_reg={format_hyperparameter(self.entropy_reg)}"
        )
