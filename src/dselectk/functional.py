"""Pure tensor math of DSelect-k (Hazimeh et al., NeurIPS 2021) and of the competing gates.

Every function here is stateless and works on any leading batch shape, so the same code serves a
static gate (``alpha: (K,)``), a bank of static gates (``(T, K)``) and a per-example gate
(``(B, K)`` or ``(B, T, K)``). Modules in :mod:`dselectk.gates` are thin wrappers around these.

Shape letters: B batch, T gates (tasks), K selectors, M = ceil(log2 n) bits, N = 2**M codes,
n experts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "binary_entropy",
    "code_table",
    "dselect_k_fused",
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
    """m = ceil(log2 n): bits a single expert selector needs for n experts (Appendix B.2)."""
    if not isinstance(num_experts, int) or isinstance(num_experts, bool):
        raise TypeError(f"num_experts must be an int, got {type(num_experts).__name__}")
    if num_experts < 2:
        raise ValueError(f"num_experts must be >= 2, got {num_experts}")
    return (num_experts - 1).bit_length()


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
    """
    _check_gamma(gamma)
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
    Section 3.2) alike.

    Args:
        alpha: (..., K) selector logits.
        z: (..., K, M) encoding variables.
        gamma: smooth-step width γ.
        num_experts: n <= 2**M; entries beyond n are dropped (Appendix B.2, no renormalisation,
            as in the reference implementation; see :func:`unused_code_penalty`).

    Returns:
        (..., n) expert weights; on the simplex when n = 2**M (Proposition 2).
    """
    if alpha.shape[-1] != z.shape[-2]:
        raise ValueError(
            f"alpha has {alpha.shape[-1]} selectors but z has {z.shape[-2]} (expected alpha "
            f"(..., K) and z (..., K, M))"
        )
    w = dselect_k_fused(alpha, z, gamma)[0]  # (..., N)
    return w if num_experts is None else w[..., :num_experts]


# -- fused per-example / static DSelect-k kernel ---------------------------------------------
#
# q̃ = Σ_i σ(α)_i r(S(z⁽ⁱ⁾)) and the selector entropies Σ_j h(S(z_ij)) in one autograd node.
# The M bits of each selector are split into a low half (M_lo = floor(M/2) bits) and a high
# half (M_hi = M - M_lo bits). Each half is expanded by successive outer products into a joint
# law of L = 2**M_lo resp. H = 2**M_hi entries (O(sqrt N) per selector), and the K weighted
# selectors are combined into the (H, L) = N entries as a sum of K outer products: the only
# tensors with N entries per example are the output and its gradient (there is no (..., K, N)
# tensor). The first M_lo bits of both halves are expanded together; when M is odd the high
# half's last bit is one more outer product, with σ(α) folded into its two factors. Everything
# runs with the batch as the innermost (contiguous) dimension, so every small op is one
# vectorised pass over the batch (a batched matmul over B tiny (H, K) @ (K, L) products costs far
# more per example); only z, α, q̃ and their gradients are transposed. The combine and its
# backward are K resp. L + H fused multiply-adds into one buffer each; the backward of the
# expansion is, per bit level, one multiply-reduce and one multiply-add.


def _batch_last(t: Tensor) -> Tensor:
    """(B, *rest) -> contiguous (*rest, B) through one 2-D transpose (the fast copy kernel)."""
    b, rest = t.shape[0], t.shape[1:]
    return t.reshape(b, -1).t().contiguous().view(*rest, b)


def _batch_first(t: Tensor) -> Tensor:
    """(*rest, B) -> contiguous (B, *rest) through one 2-D transpose."""
    b, rest = t.shape[-1], t.shape[:-1]
    return t.reshape(-1, b).t().contiguous().view(b, *rest)


def _dselect_fused_forward(
    z: Tensor, alpha: Tensor, gamma: Tensor, m_lo: int
) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
    """Forward of :class:`_DSelectFused` on z (B, K, M), α (B, K): q̃ (B, N), entropies (B, K)."""
    s = (_batch_last(z) / gamma).clamp(-0.5, 0.5)  # (K, M, B): batch innermost
    p = s * (1.5 - 2.0 * s * s) + 0.5  # smooth_step, op for op
    q = 1.0 - p
    tiny = torch.finfo(p.dtype).tiny
    log_p, log_q = torch.log(p.clamp_min(tiny)), torch.log(q.clamp_min(tiny))
    ent = (p * log_p).addcmul_(q, log_q).sum(dim=1).neg_()  # (K, B) = selector_entropy(p)
    k, m, b = p.shape
    a = torch.softmax(_batch_last(alpha), dim=0)  # (K, B)
    # Bit j of the low half (bit j) and of the high half (bit M_lo + j), j < M_lo, side by side.
    bit_p = p[:, : 2 * m_lo].view(k, 2, m_lo, b)  # (K, half, M_lo, B)
    if m_lo:
        v = torch.stack((1.0 - bit_p, bit_p), dim=2)  # (K, half, value, M_lo, B)
        prefixes = [v[:, :, :, 0]]  # joint law of the first j + 1 bits: (K, 2, 2**j, B)
        for j in range(1, m_lo):
            prefixes.append((v[:, :, :, None, j] * prefixes[-1][:, :, None]).flatten(2, 3))
    else:  # M = 1: the low half is empty
        prefixes = [p.new_ones(k, 2, 1, b)]
    r_lo = prefixes[-1][:, 0]  # (K, L, B)
    if m % 2:  # the high half's last bit, weighted by σ(α): (K, 2, 1, B) ⊗ (K, 1, L, B)
        p_top = p[:, m - 1]
        top = torch.stack((1.0 - p_top, p_top), dim=1)  # (K, value, B)
        w = top * a.unsqueeze(1)
        hia = (w.unsqueeze(2) * prefixes[-1][:, 1, None]).flatten(1, 2)  # (K, H, B)
        saved = [s, bit_p, a, log_q - log_p, top, w, hia]
    else:
        top = prefixes[-1][:, 1]  # r_hi (K, H, B)
        hia = top * a.unsqueeze(1)
        saved = [s, bit_p, a, log_q - log_p, top, hia]
    out = hia[0, :, None] * r_lo[0, None]  # (H, L, B): Σ_i outer(hia_i, r_lo_i)
    for i in range(1, k):
        out.addcmul_(hia[i, :, None], r_lo[i, None])
    return _batch_first(out).flatten(1), ent.t(), saved, prefixes


class _DSelectFused(torch.autograd.Function):
    """(z (B, K, M), α (B, K), γ) -> (q̃ (B, N), entropies (B, K), *saved); see the comment above.

    The intermediates the backward pass needs are returned as extra non-differentiable outputs
    (the ``setup_context`` form, which ``torch.func`` transforms require).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(z: Tensor, alpha: Tensor, gamma: Tensor) -> tuple[Tensor, ...]:
        out, ent, saved, prefixes = _dselect_fused_forward(z, alpha, gamma, z.shape[-1] // 2)
        return (out, ent, *saved, *prefixes)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        z, _, gamma = inputs
        ctx.m_lo = z.shape[-1] // 2
        ctx.num_saved = 7 if z.shape[-1] % 2 else 6
        ctx.set_materialize_grads(False)  # no zero grads for the unused outputs
        ctx.mark_non_differentiable(*output[2:])
        ctx.save_for_backward(gamma, *output[2:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, g_out: Tensor | None, g_ent: Tensor | None, *_: Any
    ) -> tuple[Tensor, Tensor, None]:
        gamma, *tensors = ctx.saved_tensors
        saved, prefixes = tensors[: ctx.num_saved], tensors[ctx.num_saved :]
        s, bit_p, a, dent, top = saved[:5]
        hia = saved[-1]
        m_lo: int = ctx.m_lo
        k, m, b = s.shape
        odd = m % 2 == 1
        if g_out is not None:
            r_lo = prefixes[-1][:, 0]  # (K, L, B)
            n_hi, n_lo = hia.shape[1], r_lo.shape[1]
            g = _batch_last(g_out.view(b, n_hi, n_lo))  # (H, L, B)
            g_hia = r_lo[:, 0, None] * g[None, :, 0]  # (K, H, B): grad of hia
            for i in range(1, n_lo):
                g_hia.addcmul_(r_lo[:, i, None], g[None, :, i])
            g_joint = s.new_zeros(prefixes[-1].shape)  # (K, half, L, B)
            if m_lo:
                g_lo = g_joint[:, 0]
                for i in range(n_hi):
                    g_lo.addcmul_(hia[:, i, None], g[None, i])
            if odd:  # hia = (w_0 P, w_1 P), P the high half's prefix, w = (1 - p_top, p_top) a
                w = saved[5]
                g_hia = g_hia.view(k, 2, n_lo, b)
                c = (g_hia * prefixes[-1][:, 1, None]).sum(dim=2)  # (K, value, B)
                g_a = (top * c).sum(dim=1)  # (K, B)
                g_top = a * (c[:, 1] - c[:, 0])  # d/dp_top
                g_joint[:, 1].addcmul_(g_hia[:, 0], w[:, 0, None]).addcmul_(
                    g_hia[:, 1], w[:, 1, None]
                )
            else:  # hia = r_hi a
                g_a = (g_hia * top).sum(dim=1)
                g_joint[:, 1].addcmul_(g_hia, a.unsqueeze(1))
            # Reverse the expansion prefix_j = v_j ⊗ prefix_{j-1}, v_j = (1 - p_j, p_j): with
            # d = g[value 1] - g[value 0], d/dp_j = Σ d·prefix_{j-1}, and the grad of the
            # previous level is (1 - p_j) g[value 0] + p_j g[value 1] = g[value 0] + p_j d.
            g_bits = []
            for j in range(m_lo - 1, 0, -1):
                gv = g_joint.unflatten(2, (2, -1))  # (K, 2, value, 2**j, B)
                d = gv[:, :, 1] - gv[:, :, 0]
                g_bits.append((d * prefixes[j - 1]).sum(dim=2))  # (K, 2, B)
                g_joint = torch.addcmul(gv[:, :, 0], d, bit_p[:, :, j : j + 1])
            if m_lo:  # level 0: the first factor pair itself
                g_bits.append(g_joint[:, :, 1] - g_joint[:, :, 0])
            g_bits.reverse()
            g_p = torch.stack(g_bits, dim=2).view(k, 2 * m_lo, b) if m_lo else None
            if odd:
                g_top = g_top.unsqueeze(1)
                g_p = g_top if g_p is None else torch.cat((g_p, g_top), dim=1)
            assert g_p is not None
        else:
            g_p = torch.zeros_like(s)  # (K, M, B)
            g_a = torch.zeros_like(a)  # (K, B)
        if g_ent is not None:
            g_p = torch.addcmul(g_p, _batch_last(g_ent).unsqueeze(1), dent)
        # dS/dz = (1.5 - 6 s²) / γ, exactly 0 at |s| = 1/2 (so the clamp needs no mask).
        g_z = _batch_first(g_p * (1.5 - 6.0 * s * s) / gamma)
        g_alpha = a * (g_a - (g_a * a).sum(dim=0))  # softmax backward, (K, B)
        return g_z, _batch_first(g_alpha), None


#: below this many selector entries (gates × K × 2**M), :func:`dselect_k_fused` composes
#: autograd ops instead of calling the kernel: fewer ops, 20-40 % faster there (measured on a
#: 2-core CPU: e.g. 2 gates, K = 2, n = 8: 0.41 vs 0.64 ms fwd+bwd; the kernel wins from about
#: 16k entries on, 4x at 2M)
FUSED_MIN_ELEMENTS = 8192


def dselect_k_fused(alpha: Tensor, z: Tensor, gamma: float | Tensor = 1.0) -> tuple[Tensor, Tensor]:
    """DSelect-k weights over all N = 2**M codes and the per-selector entropies, fused.

    Same numbers as ``dselect_k_weights(alpha, z, gamma)`` and
    ``selector_entropy(smooth_step(z, gamma))`` (tested, values and gradients), in one autograd
    node whose memory and time are O(N + K·sqrt(N)) per gate (see the comment above). γ gets no
    gradient; a γ that requires one, and problems smaller than :data:`FUSED_MIN_ELEMENTS`, use
    the composed formulation.

    Args:
        alpha: (..., K) selector logits.
        z: (..., K, M) encoding variables.
        gamma: smooth-step width γ > 0: a float, a 0-d tensor, or a tensor broadcastable to the
            leading shape ``...`` (one γ per gate, e.g. a bank of gates tuned together).

    Returns:
        ``(weights (..., N), entropies (..., K))``.
    """
    if alpha.shape[-1] != z.shape[-2]:
        raise ValueError(
            f"alpha has {alpha.shape[-1]} selectors but z has {z.shape[-2]} (expected alpha "
            f"(..., K) and z (..., K, M))"
        )
    _check_gamma(gamma)
    lead = torch.broadcast_shapes(alpha.shape[:-1], z.shape[:-2])
    k, m = z.shape[-2:]
    small = math.prod(lead) * k * 2**m <= FUSED_MIN_ELEMENTS
    if small or (isinstance(gamma, Tensor) and gamma.requires_grad):
        if isinstance(gamma, Tensor) and gamma.dim() > 0:
            gamma = gamma.expand(lead)[..., None, None]  # one γ per gate, against (..., K, M)
        p = smooth_step(z, gamma)
        w = _expand_bits(p, torch.softmax(alpha, dim=-1).unsqueeze(-1)).sum(dim=-2)
        return w, selector_entropy(p)
    g = torch.as_tensor(gamma, dtype=z.dtype, device=z.device)
    if g.dim() > 0:  # one γ per gate: flattened like the gates (the kernel's batch axis)
        g = g.expand(lead).reshape(-1)
    alpha = alpha.expand(*lead, alpha.shape[-1])
    z = z.expand(*lead, *z.shape[-2:])
    out, ent = _DSelectFused.apply(z.reshape(-1, k, m), alpha.reshape(-1, k), g)[:2]
    return out.view(*lead, out.shape[-1]), ent.reshape(*lead, k)


def binary_entropy(p: Tensor) -> Tensor:
    """h(p) = -p log p - (1-p) log(1-p), exactly 0 with a finite gradient at p in {0, 1}."""
    tiny = torch.finfo(p.dtype).tiny
    q = 1.0 - p
    return -(p * torch.log(p.clamp_min(tiny)) + q * torch.log(q.clamp_min(tiny)))


def entropy(prob: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy (nats) of probability vectors along ``dim``; safe at exact zeros."""
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


def keep_topk(logits: Tensor, k: int) -> Tensor:
    """KeepTopK(v)_i = v_i if v_i is among the k largest entries of v, else -inf (Section 2)."""
    vals, idx = logits.topk(k, dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, idx, vals)


def topk_softmax(logits: Tensor, k: int) -> Tensor:
    """Top-k gate σ(KeepTopK(v)) along the last dim, computed as a softmax over the k kept logits.

    Equals ``softmax(keep_topk(v, k))`` (tested) without an n-wide softmax over -inf entries.
    """
    vals, idx = logits.topk(k, dim=-1)
    return torch.zeros_like(logits).scatter(-1, idx, F.softmax(vals, dim=-1))
