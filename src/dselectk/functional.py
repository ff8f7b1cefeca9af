"""Pure tensor math of DSelect-k (Hazimeh et al., NeurIPS 2021) and of the competing gates.

Every function here is stateless and works on any leading batch shape, so the same code serves a
static gate (``alpha: (K,)``), a bank of static gates (``(T, K)``) and a per-example gate
(``(B, K)`` or ``(B, T, K)``). Modules in :mod:`dselectk.gates` are thin wrappers around these.

This module is pure math, the formulas as written: the kernels that compute some of them in one
node (e.g. :func:`dselectk.kernels.dselect_k_fused`, DSelect-k's weights and entropies), and the
choice between them, live in :mod:`dselectk.kernels`.

Shape letters: B batch, T gates (tasks), K selectors, M = ceil(log2 n) bits, N = 2**M codes,
n experts.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "binary_entropy",
    "code_collisions",
    "code_table",
    "distinct_codes",
    "dselect_k_weights",
    "entropy",
    "keep_topk",
    "num_bits",
    "selector",
    "selector_entropy",
    "selector_naive",
    "smooth_step",
    "topk_softmax",
    "unused_code_penalty",
]


def num_bits(num_experts: int) -> int:
    """m = ceil(log2 n): bits a single expert selector needs for n experts (Appendix B.2).

    Examples:
        >>> from dselectk.functional import num_bits
        >>> num_bits(2), num_bits(5), num_bits(8), num_bits(9)
        (1, 3, 3, 4)
    """
    if isinstance(num_experts, bool) or not hasattr(type(num_experts), "__index__"):
        raise TypeError(f"num_experts must be an int, got {type(num_experts).__name__}")
    n = operator.index(num_experts)  # also NumPy integers
    if n < 2:
        raise ValueError(f"num_experts must be >= 2, got {n}")
    return (n - 1).bit_length()


def _check_gamma(gamma: float | Tensor) -> None:
    if isinstance(gamma, Tensor):
        if torch.compiler.is_compiling():
            return
        if gamma.numel() == 1:  # the common case: one sync, no temporaries
            _check_gamma(float(gamma.detach()))
            return
        g = gamma.detach()
        if not bool(((g > 0) & torch.isfinite(g)).all()):
            bad = g.flatten()[~((g.flatten() > 0) & torch.isfinite(g.flatten()))][0]
            raise ValueError(f"gamma must be a finite number > 0, got {float(bad)}")
        return
    g_f = float(gamma)
    if not (g_f > 0.0 and math.isfinite(g_f)):
        raise ValueError(f"gamma must be a finite number > 0, got {g_f}")


def smooth_step(t: Tensor, gamma: float | Tensor = 1.0) -> Tensor:
    """Cubic smooth-step S(t; γ) of Section 3.1.3.

    S(t) = 0 for t <= -γ/2, 1 for t >= γ/2, and -2t³/γ³ + 3t/(2γ) + 1/2 in between. It is C¹ with
    S'(±γ/2) = 0, and returns exact 0/1 outside the fractional region, so the gradient there is
    exactly zero (the property that freezes a converged selector).

    Args:
        t: any shape.
        gamma: width γ > 0 of the fractional region: a float, a 0-d tensor (e.g. a buffer a
            schedule updates in place), or a tensor broadcastable to ``t`` (one γ per entry).

    Returns:
        Tensor of the shape of ``t``.

    Examples:
        >>> import torch
        >>> from dselectk.functional import smooth_step
        >>> smooth_step(torch.tensor([-1.0, -0.25, 0.0, 0.25, 1.0]), gamma=1.0)
        tensor([0.0000, 0.1562, 0.5000, 0.8438, 1.0000])
        >>> smooth_step(torch.randn(4, 3, 2), gamma=torch.tensor(0.5)).shape  # any shape
        torch.Size([4, 3, 2])
    """
    _check_gamma(gamma)
    return _smooth(t, gamma)


def _smooth(t: Tensor, gamma: float | Tensor) -> Tensor:
    """:func:`smooth_step` without its check (``gamma`` already validated, e.g. a
    gate's γ buffer, validated when written: no device sync per call)."""
    # With s = t/γ the cubic is s(1.5 - 2s²) + 0.5; clamping s to [-1/2, 1/2] makes both ends
    # exact in floating point (0.5 * 1.0 ± 0.5) and gives a zero gradient outside.
    s = (t / gamma).clamp(-0.5, 0.5)
    return s * (1.5 - 2.0 * s * s) + 0.5


def code_table(num_experts: int, *, device: torch.device | None = None) -> Tensor:
    """Binary codes of the experts: ``table[i, j]`` is bit j of i (least significant bit first).

    Row i (0-based) is the code of expert i + 1 in the paper's 1-based notation, i.e. the set
    B(i) of Section 3.1.1. Built with integer bit operations (no string round trips).

    Returns:
        bool tensor of shape (n, M).

    Examples:
        >>> from dselectk.functional import code_table
        >>> code_table(4)  # (n, M): expert 2 (0-based) has code 01, bit 0 first
        tensor([[False, False],
                [ True, False],
                [False,  True],
                [ True,  True]])
        >>> code_table(5).shape
        torch.Size([5, 3])
    """
    m = num_bits(num_experts)
    idx = torch.arange(num_experts, device=device)
    return ((idx.unsqueeze(-1) >> torch.arange(m, device=device)) & 1).bool()


def selector(p: Tensor, num_experts: int | None = None) -> Tensor:
    """Single expert selector r(p) of Section 3.1.1, Eq. (r(z)_i), for p = S(z) in [0, 1]^M.

    r(p)_i = prod_{j in B(i-1)} p_j * prod_{j not in B(i-1)} (1 - p_j). r(p) is the joint law of
    M independent bits (bit j is 1 with probability p_j, bit 1 the least significant), so it is
    expanded by M successive outer products in O(N) work instead of an (N, M) product table.

    Args:
        p: (..., M) bit probabilities.
        num_experts: keep only the first n entries (n not a power of two, Appendix B.2);
            default all N = 2**M.

    Returns:
        (..., n) selector outputs.

    Examples:
        >>> import torch
        >>> from dselectk.functional import selector
        >>> selector(torch.tensor([0.0, 1.0]))  # binary bits (0, 1): expert 2 (0-based)
        tensor([0., 0., 1., 0.])
        >>> selector(torch.tensor([0.5, 1.0]), num_experts=3)  # (M,) -> (n,)
        tensor([0.0000, 0.0000, 0.5000])
        >>> selector(torch.rand(8, 4, 3)).shape  # (..., M) -> (..., 2**M)
        torch.Size([8, 4, 8])
    """
    out = _expand_bits(p, p.new_ones(()).expand(*p.shape[:-1], 1))
    return out if num_experts is None else out[..., :num_experts]


def _expand_bits(p: Tensor, w: Tensor) -> Tensor:
    """Multiply ``w (..., 1)`` by the joint law of the bits ``p (..., M)``: returns (..., 2**M)."""
    for j in range(p.shape[-1]):
        pj = p[..., j : j + 1]
        # New index = old index + 2**j * bit_j: the bit-0 half comes first.
        w = torch.cat((w * (1.0 - pj), w * pj), dim=-1)
    return w


def selector_naive(p: Tensor, num_experts: int | None = None) -> Tensor:
    """Reference formulation of r(p): the paper's product formula over an (N, M) code table.

    This is the way a reader would first code Eq. (r(z)_i); kept for tests and benchmarks.

    Examples:
        >>> import torch
        >>> from dselectk.functional import selector, selector_naive
        >>> p = torch.rand(6, 3)  # (..., M)
        >>> selector_naive(p).shape, torch.allclose(selector_naive(p), selector(p))
        (torch.Size([6, 8]), True)
    """
    m = p.shape[-1]
    table = code_table(2**m, device=p.device)  # (N, M)
    factors = torch.where(table, p.unsqueeze(-2), 1.0 - p.unsqueeze(-2))  # (..., N, M)
    out = factors.prod(dim=-1)
    return out if num_experts is None else out[..., :num_experts]


def dselect_k_weights(
    alpha: Tensor, z: Tensor, gamma: float | Tensor = 1.0, num_experts: int | None = None
) -> Tensor:
    """DSelect-k gate q̃(α, Z) = Σ_i σ(α)_i r(S(z⁽ⁱ⁾)) (Section 3.1.3, Eq. smoothed_router).

    Used for the static gate (α, Z parameters) and the per-example gate (α = Gx, Z = Wx,
    Section 3.2) alike. The formulas as written (memory O(K·N) per gate); the gates compute the
    same numbers (to float rounding, tested) in one node through
    :func:`dselectk.kernels.dselect_k_fused`, which is O(N + K·sqrt(N)) per gate.

    Args:
        alpha: (..., K) selector logits.
        z: (..., K, M) encoding variables.
        gamma: smooth-step width γ > 0: a float, a 0-d tensor, or a tensor broadcastable to the
            leading shape ``...`` (one γ per gate).
        num_experts: n <= 2**M; entries beyond n are dropped (Appendix B.2, no renormalisation,
            as in the reference implementation; see :func:`unused_code_penalty`).

    Returns:
        (..., n) expert weights; on the simplex when n = 2**M (Proposition 2).

    Examples:
        >>> import torch
        >>> from dselectk.functional import dselect_k_weights
        >>> alpha, z = torch.randn(4, 2), torch.randn(4, 2, 3)  # B=4, K=2 selectors, M=3 bits
        >>> w = dselect_k_weights(alpha, z, gamma=1.0)
        >>> w.shape, torch.allclose(w.sum(-1), torch.ones(4))  # (B, 2**M), on the simplex
        (torch.Size([4, 8]), True)
        >>> dselect_k_weights(alpha, z, num_experts=5).shape
        torch.Size([4, 5])
    """
    _check_gamma(gamma)
    w = _dselect_k_composed(alpha, z, gamma)[0]  # (..., N)
    return w if num_experts is None else w[..., :num_experts]


def _dselect_k_composed(alpha: Tensor, z: Tensor, gamma: float | Tensor) -> tuple[Tensor, Tensor]:
    """DSelect-k's weights over all N = 2**M codes (..., N) and the selector entropies (..., K)
    by the formulas as written (``gamma`` already checked)."""
    if alpha.shape[-1] != z.shape[-2]:
        raise ValueError(
            f"alpha has {alpha.shape[-1]} selectors but z has {z.shape[-2]} (expected alpha "
            f"(..., K) and z (..., K, M))"
        )
    if isinstance(gamma, Tensor) and gamma.dim() > 0:
        lead = alpha.shape[:-1]
        if lead != z.shape[:-2]:
            lead = torch.broadcast_shapes(lead, z.shape[:-2])
        gamma = gamma.expand(lead)[..., None, None]  # one γ per gate, against (..., K, M)
    p = _smooth(z, gamma)
    w = _expand_bits(p, torch.softmax(alpha, dim=-1).unsqueeze(-1)).sum(dim=-2)
    return w, selector_entropy(p)


def binary_entropy(p: Tensor) -> Tensor:
    """h(p) = -p log p - (1-p) log(1-p), exactly 0 with a finite gradient at p in {0, 1}.

    Examples:
        >>> import torch
        >>> from dselectk.functional import binary_entropy
        >>> binary_entropy(torch.tensor([0.1, 0.5, 0.9]))
        tensor([0.3251, 0.6931, 0.3251])
        >>> p = torch.tensor([0.0, 1.0], requires_grad=True)
        >>> h = binary_entropy(p)
        >>> h.sum().backward()
        >>> bool((h == 0).all()), bool(p.grad.isfinite().all())
        (True, True)
    """
    tiny = torch.finfo(p.dtype).tiny
    q = 1.0 - p
    return -(p * torch.log(p.clamp_min(tiny)) + q * torch.log(q.clamp_min(tiny)))


def entropy(prob: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy (nats) of probability vectors along ``dim``; safe at exact zeros.

    Examples:
        >>> import torch
        >>> from dselectk.functional import entropy
        >>> entropy(torch.tensor([[0.5, 0.5], [0.25, 0.75]]))  # (B, n) -> (B,)
        tensor([0.6931, 0.5623])
        >>> entropy(torch.tensor([[0.5, 0.25], [0.5, 0.75]]), dim=0)  # (n, B) -> (B,)
        tensor([0.6931, 0.5623])
    """
    tiny = torch.finfo(prob.dtype).tiny
    return -(prob * torch.log(prob.clamp_min(tiny))).sum(dim=dim)


def selector_entropy(p: Tensor) -> Tensor:
    """Entropy h(r(p)) of each selector, computed as Σ_j h(p_j) in O(M).

    Because r(p) is the joint law of M independent bits, its entropy is the sum of the bits'
    binary entropies (over all N = 2**M codes). Proven against :func:`entropy` of
    :func:`selector` in the tests.

    Args:
        p: (..., M) bit probabilities S(z).

    Returns:
        (...,) entropies.

    Examples:
        >>> import torch
        >>> from dselectk.functional import entropy, selector, selector_entropy
        >>> p = torch.rand(5, 3)  # (..., M) bit probabilities
        >>> selector_entropy(p).shape, torch.allclose(selector_entropy(p), entropy(selector(p)))
        (torch.Size([5]), True)
    """
    return binary_entropy(p).sum(dim=-1)


def unused_code_penalty(p: Tensor, num_experts: int, xi: float) -> Tensor:
    """Appendix B.2 penalty ξ / Σ_{i<=n} r(p)_i for each selector, when n < 2**M.

    Σ_{i<=n} r(p)_i is the probability that the M-bit number is < n, computed from the bits by a
    carry recursion in O(M) (no expansion). The denominator is clamped at the dtype's eps so that
    a selector parked on an unused code gives a large but finite penalty.

    Args:
        p: (..., M) bit probabilities.
        num_experts: n.
        xi: ξ >= 0.

    Returns:
        (...,) penalties (zeros when n = 2**M).

    Examples:
        >>> import torch
        >>> from dselectk.functional import unused_code_penalty
        >>> p = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.5]])  # (K, M): code 0; uniform over 8
        >>> unused_code_penalty(p, num_experts=5, xi=0.1)  # xi / P(code < 5)
        tensor([0.1000, 0.1600])
        >>> unused_code_penalty(p, num_experts=8, xi=0.1)  # n = 2**M: no unused codes
        tensor([0., 0.])
    """
    m = p.shape[-1]
    if num_experts >= 2**m:
        return p.new_zeros(p.shape[:-1])
    # P(X < n) from the most significant bit down: where n has bit 1, X < n if X's bit is 0
    # (then any lower bits) or X's bit is 1 and the rest is smaller; where n has bit 0, X's bit
    # must be 0 and the rest smaller.
    less = p.new_zeros(p.shape[:-1])
    for j in range(m):  # least significant first: less_j = P(X mod 2^(j+1) < n mod 2^(j+1))
        pj = p[..., j]
        less = (1.0 - pj) + pj * less if (num_experts >> j) & 1 else (1.0 - pj) * less
    return xi / less.clamp_min(torch.finfo(p.dtype).eps)


def code_collisions(codes: Tensor, num_experts: int) -> Tensor:
    """Pairs i < j of selectors of one gate that pick the same expert, mean over examples.

    Args:
        codes: (N, T, K) long, the expert (code) of each of K selectors of T gates, for N
            examples (N = 1 for a static gate). Codes >= ``num_experts`` select no expert and
            never collide.
        num_experts: n.

    Returns:
        (T,) float: the number of colliding pairs of each gate, averaged over the N examples.

    Examples:
        >>> import torch
        >>> from dselectk.functional import code_collisions
        >>> codes = torch.tensor([[[1, 1, 2], [0, 1, 2]], [[3, 3, 3], [0, 1, 4]]])  # (N, T, K)
        >>> code_collisions(codes, num_experts=4)  # gate 0: 1 pair, then 3 pairs; gate 1: none
        tensor([2., 0.])
    """
    k = codes.shape[-1]
    same = codes.unsqueeze(-1) == codes.unsqueeze(-2)  # (N, T, K, K)
    valid = (codes < num_experts).unsqueeze(-1)
    upper = torch.ones(k, k, dtype=torch.bool, device=codes.device).triu(1)
    return (same & valid & upper).sum((-1, -2)).float().mean(0)


def distinct_codes(z: Tensor, num_experts: int) -> Tensor:
    """Z with the fewest, least confident bits negated so that the K selectors of every gate
    have distinct codes that are experts (ours, not the paper's; ``DSelectK(distinct=True)``).

    Selector i's code is its sign pattern (bit m is 1 where z_m > 0, as S(z_m) > 1/2). Selectors
    are taken in order i = 1..K; selector i keeps its code unless an earlier selector holds it or
    it is no expert (>= n), and otherwise moves to the free expert code c that is cheapest to
    reach: the one minimising Σ_m |z_im| over the bits m where c differs from its code (ties: the
    smallest code). Moving negates those entries, z_im -> -z_im, so S(z_im) -> 1 - S(z_im): a
    reflection of the selector's law, which keeps r(S(z)) a product of independent bits and the
    gradient an exact ±1 per entry. Once S(Z) is binary the gate selects exactly K distinct
    experts.

    Continuity: when selector i's code walks into an earlier selector's code by one bit crossing
    zero, that bit is the least confident one and is negated at |z_im| = 0, where S is 1/2
    either way: no jump. The law does jump where the choice of negated bits changes (equal
    costs) or where an earlier selector moves onto a later one's code, as Top-k jumps at ties.

    Args:
        z: (..., K, M) encoding variables (any leading shape: static, bank, per example).
        num_experts: n, with K <= n <= 2**M.

    Returns:
        (..., K, M), ``z`` times a ±1 mask (no gradient through the mask).

    Examples:
        >>> import torch
        >>> from dselectk.functional import distinct_codes
        >>> z = torch.tensor([[2.0, 1.0], [1.5, 0.5]])  # (K, M): both selectors on code 3
        >>> distinct_codes(z, num_experts=4)  # the second moves to code 1, flipping its weakest bit
        tensor([[ 2.0000,  1.0000],
                [ 1.5000, -0.5000]])
        >>> distinct_codes(torch.randn(8, 3, 2, 3), num_experts=6).shape  # (..., K, M)
        torch.Size([8, 3, 2, 3])
    """
    k, m = z.shape[-2], z.shape[-1]
    if k > num_experts:
        raise ValueError(f"distinct codes need K <= n, got K={k} selectors for n={num_experts}")
    codes = 1 << m
    table = (
        (torch.arange(codes, device=z.device).unsqueeze(-1) >> torch.arange(m, device=z.device)) & 1
    ).to(z.dtype)  # (C, M)
    with torch.no_grad():
        a = z.abs()
        own = (z > 0).to(z.dtype)  # (..., K, M)
        # cost(c) = Σ_m a_m [own_m != c_m] = Σ a·own + a @ c - 2 (a·own) @ c
        cost = (a * own).sum(-1, keepdim=True) + (a - 2 * a * own) @ table.t()  # (..., K, C)
        taken = torch.zeros((*cost.shape[:-2], codes), dtype=torch.bool, device=z.device)
        taken[..., num_experts:] = True
        flips = []
        for i in range(k):
            best = cost[..., i, :].masked_fill(taken, math.inf).argmin(-1)  # (...,)
            taken = taken | (best.unsqueeze(-1) == torch.arange(codes, device=z.device))
            flips.append(own[..., i, :] != table[best])  # (..., M)
        sign = 1 - 2 * torch.stack(flips, -2).to(z.dtype)
    return z * sign


def keep_topk(logits: Tensor, k: int) -> Tensor:
    """KeepTopK(v)_i = v_i if v_i is among the k largest entries of v, else -inf (Section 2).

    Examples:
        >>> import torch
        >>> from dselectk.functional import keep_topk
        >>> keep_topk(torch.tensor([1.0, 3.0, 2.0, 0.0]), k=2)
        tensor([-inf, 3., 2., -inf])
        >>> keep_topk(torch.randn(5, 8), k=2).isfinite().sum(-1)  # (..., n), k kept per row
        tensor([2, 2, 2, 2, 2])
    """
    vals, idx = logits.topk(k, dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, idx, vals)


def topk_softmax(logits: Tensor, k: int) -> Tensor:
    """Top-k gate σ(KeepTopK(v)) along the last dim, computed as a softmax over the k kept logits.

    Equals ``softmax(keep_topk(v, k))`` (tested) without an n-wide softmax over -inf entries.

    Examples:
        >>> import torch
        >>> from dselectk.functional import topk_softmax
        >>> topk_softmax(torch.tensor([1.0, 3.0, 2.0, 0.0]), k=2)
        tensor([0.0000, 0.7311, 0.2689, 0.0000])
        >>> w = topk_softmax(torch.randn(5, 8), k=2)  # (..., n)
        >>> w.shape, (w > 0).sum(-1).tolist()
        (torch.Size([5, 8]), [2, 2, 2, 2, 2])
    """
    vals, idx = logits.topk(k, dim=-1)
    return torch.zeros_like(logits).scatter(-1, idx, F.softmax(vals, dim=-1))
