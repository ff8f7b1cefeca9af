"""Compiled CPU kernels of the DSelect-k gate (numba; the ``fast`` extra).

Imported by :mod:`dselectk.runtime` only when the numba kernel is in use (see there: the
``DSELECTK_KERNEL`` variable); importing this module imports numba. One forward and one
backward over a gate's logits (G, K(1+M)) (α the first K columns, then Z (K, M)), one thread,
without the GIL, float32 and float64 (one compiled specialisation each, on first use).

Per selector i of gate g, with p_j = S(z_ij / γ) (the smooth-step, op for op as the ATen
kernels write it) and q_j = 1 - p_j, the law r(p) over the N = 2**M codes (bit j worth 2**j) is
the outer product of the laws of the low M_lo = ceil(M/2) bits (L = 2**M_lo codes) and of the
high bits (H = N / L), each built by doubling: from [1], for each bit the entries v so far
become (v q_j, v p_j). The gate's weights are Σ_i (σ(α)_i hi_i) ⊗ lo_i (code = high · L + low),
K·N multiply-adds, no (K, N) tensor. The entropy is Σ_j h(p_j) with clamped logs (as
:func:`dselectk.functional.binary_entropy`); the loss λ Σ_i h_i per gate is summed over the
gates in float64 and divided by ``divisor``. log(1 - p_j) - log p_j is kept for the backward.

The backward recomputes the halves' doublings with their levels (the law of the first r bits)
and walks them back: with G the grad of level r + 1, d/dp = Σ_c (G[c + 2**r] - G[c]) level_r[c]
and the grad of level r is G[c] q + G[c + 2**r] p; the halves' grads are g_hi_i = g lo_i and
g_lo_i = gᵀ (σ(α)_i hi_i), with g the (H, L) grad of the gate's row. No division anywhere:
exact at binary bits (zero factors). The grad of σ(α)_i is ⟨g_hi_i, hi_i⟩, the softmax
backward gives α's, and dS/dz = (1.5 - 6 s²)/γ (exactly 0 at the clamp) z's.

Below ``_TILES_MIN_GATES`` gates the kernels loop over the gates; from there on they take tiles
of ``_TILE`` gates with the gates innermost, which LLVM vectorises (bit for bit the per-gate
numbers, tested). Comparisons are branch-free selects and the float32 log is Cephes' ``logf``
in plain arithmetic (:func:`_logf`), so those loops vectorise too; float64 uses libm's log.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from dselectk._numba_ops import _log, _lt_select
from dselectk._numba_tiles import _backward_tiles, _forward_tiles

__all__: list[str] = []


@njit(cache=True, nogil=True, inline="always")
def _softmax_into(row: Any, k: int, a: Any) -> None:  # pragma: no cover - compiled
    """σ(row[:k]) into ``a`` (a NaN logit gives NaNs)."""
    top = row[0]
    for i in range(1, k):
        top = _lt_select(top, row[i], row[i], top)
    total = a.dtype.type(0.0)
    for i in range(k):
        e = np.exp(row[i] - top)
        a[i] = e
        total += e
    for i in range(k):
        a[i] = a[i] / total


@njit(cache=True, nogil=True, inline="always")
def _bits_into(
    row: Any, k: int, km: int, gam: Any, s: Any, p: Any, q: Any
) -> None:  # pragma: no cover - compiled
    """s = clamp(z / γ, ±1/2), p = S(z) = s (1.5 - 2 s²) + 0.5 and q = 1 - p of the K·M bits of
    a gate (``row[k:]``), op for op as the ATen and NumPy kernels (NaN stays NaN)."""
    one = s.dtype.type(1.0)
    half = s.dtype.type(0.5)
    c15 = s.dtype.type(1.5)
    c2 = s.dtype.type(-2.0)
    for j in range(km):
        v = row[k + j] / gam
        v = _lt_select(v, -half, -half, v)
        v = _lt_select(half, v, half, v)
        s[j] = v
        pj = v * v
        pj = pj * c2
        pj = pj + c15
        pj = pj * v
        pj = pj + half
        p[j] = pj
        q[j] = one - pj


@njit(cache=True, nogil=True, inline="always")
def _law_into(p: Any, q: Any, j0: int, bits: int, lev: Any) -> None:  # pragma: no cover - compiled
    """The levels of the doubling of bits j0 .. j0 + bits - 1: level t (the law of the first t
    of them, 2**t entries) at ``lev[2**t : 2**(t+1)]``; the last level is the law itself."""
    lev[1] = 1.0
    w = 1
    for t in range(bits):
        pj = p[j0 + t]
        qj = q[j0 + t]
        for c in range(w):
            v = lev[w + c]
            lev[2 * w + c] = v * qj
            lev[3 * w + c] = v * pj
        w *= 2


@njit(cache=True, nogil=True, inline="always")
def _law_grad(
    p: Any, q: Any, j0: int, bits: int, lev: Any, gl: Any, g_p: Any
) -> None:  # pragma: no cover - compiled
    """Walk :func:`_law_into` back: ``gl`` (2**bits) holds the grad of the law (overwritten);
    the grads of p_j0 .. p_(j0 + bits - 1) go to ``g_p``."""
    zero = gl.dtype.type(0.0)
    for t in range(bits - 1, -1, -1):
        w = 1 << t
        pj = p[j0 + t]
        qj = q[j0 + t]
        acc = zero
        for c in range(w):
            g0 = gl[c]
            g1 = gl[c + w]
            acc += (g1 - g0) * lev[w + c]
            gl[c] = g0 * qj + g1 * pj
        g_p[j0 + t] = acc


@njit(cache=True, nogil=True)
def _forward_gates(
    logits: Any,
    k: int,
    gam: Any,
    lam: Any,
    divisor: float,
    tiny: float,
    out: Any,
    state: Any,
) -> float:  # pragma: no cover - compiled
    """Weights ``out`` (G, N) of the gates' logits (G, K(1+M)) and the state (G, 2K + K·M):
    per gate the K entropies, σ(α) and log(1 - p) - log p of each bit (for the backward).
    Returns the loss Σ_g λ_g Σ_i h_gi / divisor (float64). γ (P,) and λ (Q,) hold one value or
    one per gate: gate g reads entry g mod P (g mod Q), the last axis of the gates' layout."""
    g_count, c = logits.shape
    m = c // k - 1
    km = k * m
    m_lo = (m + 1) // 2
    m_hi = m - m_lo
    n_lo = 1 << m_lo
    n_hi = 1 << m_hi
    dt = logits.dtype.type
    tiny_t = dt(tiny)
    zero = dt(0.0)
    s = np.empty(km, logits.dtype)
    p = np.empty(km, logits.dtype)
    q = np.empty(km, logits.dtype)
    h = np.empty(km, logits.dtype)
    lev_lo = np.empty(2 * n_lo, logits.dtype)
    lev_hi = np.empty(2 * n_hi, logits.dtype)
    lo = np.empty((k, n_lo), logits.dtype)
    hi = np.empty((k, n_hi), logits.dtype)
    loss = 0.0
    for g in range(g_count):
        row = logits[g]
        st = state[g]
        a = st[k : 2 * k]
        _softmax_into(row, k, a)
        _bits_into(row, k, km, gam[g % gam.size], s, p, q)
        dent = st[2 * k :]
        for j in range(km):  # clamped logs, as functional.binary_entropy
            pj = p[j]
            qj = q[j]
            log_p = _log(_lt_select(pj, tiny_t, tiny_t, pj))
            log_q = _log(_lt_select(qj, tiny_t, tiny_t, qj))
            h[j] = pj * log_p + qj * log_q
            dent[j] = log_q - log_p
        total = 0.0
        for i in range(k):
            e = zero
            for j in range(i * m, (i + 1) * m):
                e += h[j]
            st[i] = -e
            total += -e
            _law_into(p[i * m : (i + 1) * m], q[i * m : (i + 1) * m], 0, m_lo, lev_lo)
            _law_into(p[i * m : (i + 1) * m], q[i * m : (i + 1) * m], m_lo, m_hi, lev_hi)
            ai = a[i]
            for c2 in range(n_lo):
                lo[i, c2] = lev_lo[n_lo + c2]
            for c2 in range(n_hi):
                hi[i, c2] = ai * lev_hi[n_hi + c2]
        o = out[g]
        for c1 in range(n_hi):  # code = high · L + low: Σ_i hi_i ⊗ lo_i
            v = hi[0, c1]
            for c2 in range(n_lo):
                o[c1 * n_lo + c2] = v * lo[0, c2]
            for i in range(1, k):
                v = hi[i, c1]
                for c2 in range(n_lo):
                    o[c1 * n_lo + c2] += v * lo[i, c2]
        loss += lam[g % lam.size] * total
    return loss / divisor


@njit(cache=True, nogil=True)
def _backward_gates(
    logits: Any,
    k: int,
    gam: Any,
    state: Any,
    g_out: Any,
    has_out: bool,
    g_ent: Any,
    g_scale: float,
    grad: Any,
) -> None:  # pragma: no cover - compiled
    """The grad of the logits ``grad`` (G, K(1+M)) from the grad of the weights ``g_out``
    (G, N; read only with ``has_out``) and of the entropies, ``g_scale`` · ``g_ent``
    (float64 (R, C), broadcast: selector (g, i) reads entry (g mod R, i mod C)); ``state``
    as :func:`gate_forward` left it."""
    g_count, c = logits.shape
    m = c // k - 1
    km = k * m
    m_lo = (m + 1) // 2
    m_hi = m - m_lo
    n_lo = 1 << m_lo
    n_hi = 1 << m_hi
    dt = logits.dtype.type
    c15 = dt(1.5)
    c6 = dt(-6.0)
    zero = dt(0.0)
    rows, cols = g_ent.shape
    g_a = np.empty(k, logits.dtype)
    s = np.empty(km, logits.dtype)
    p = np.empty(km, logits.dtype)
    q = np.empty(km, logits.dtype)
    g_p = np.empty(km, logits.dtype)
    ge = np.empty(km, np.float64)
    lev_lo = np.empty((k, 2 * n_lo), logits.dtype)
    lev_hi = np.empty((k, 2 * n_hi), logits.dtype)
    g_lo = np.empty((k, n_lo), logits.dtype)
    g_hi = np.empty((k, n_hi), logits.dtype)
    for g in range(g_count):
        row = logits[g]
        st = state[g]
        a = st[k : 2 * k]
        gm = gam[g % gam.size]
        gr = grad[g]
        _bits_into(row, k, km, gm, s, p, q)
        if has_out:
            go = g_out[g]
            for i in range(k):
                _law_into(p[i * m : (i + 1) * m], q[i * m : (i + 1) * m], 0, m_lo, lev_lo[i])
                _law_into(p[i * m : (i + 1) * m], q[i * m : (i + 1) * m], m_lo, m_hi, lev_hi[i])
                for c2 in range(n_lo):
                    g_lo[i, c2] = zero
            # g_hi_i[h] = Σ_l g[h, l] lo_i[l] and g_lo_i[l] = Σ_h g[h, l] σ(α)_i hi_i[h]
            for c1 in range(n_hi):
                base = c1 * n_lo
                for i in range(k):
                    acc = zero
                    w = a[i] * lev_hi[i, n_hi + c1]
                    for c2 in range(n_lo):
                        gv = go[base + c2]
                        acc += gv * lev_lo[i, n_lo + c2]
                        g_lo[i, c2] += gv * w
                    g_hi[i, c1] = acc
            for i in range(k):
                acc = zero
                ai = a[i]
                for c1 in range(n_hi):
                    acc += g_hi[i, c1] * lev_hi[i, n_hi + c1]
                    g_hi[i, c1] *= ai
                g_a[i] = acc
            for i in range(k):
                gp = g_p[i * m : (i + 1) * m]
                _law_grad(
                    p[i * m : (i + 1) * m], q[i * m : (i + 1) * m], 0, m_lo, lev_lo[i], g_lo[i], gp
                )
                _law_grad(
                    p[i * m : (i + 1) * m],
                    q[i * m : (i + 1) * m],
                    m_lo,
                    m_hi,
                    lev_hi[i],
                    g_hi[i],
                    gp,
                )
        else:
            for i in range(k):
                g_a[i] = zero
            for j in range(km):
                g_p[j] = zero
        for i in range(k):  # the entropies' grads, in float64 (see runtime._numba_gate_grad)
            e = g_scale * g_ent[g % rows, i % cols]
            for j in range(i * m, (i + 1) * m):
                ge[j] = e
        dent = st[2 * k :]
        for j in range(km):  # d h(p) / dp = log(1 - p) - log p (clamped logs)
            gpj = dt(g_p[j] + ge[j] * dent[j])  # (+ 0 without an entropy grad: exact)
            d = s[j] * s[j]
            d = d * c6
            d = d + c15
            d = d * gpj
            gr[k + j] = d / gm
        dot = zero
        for i in range(k):
            dot += g_a[i] * a[i]
        for i in range(k):
            gr[i] = a[i] * (g_a[i] - dot)  # softmax backward


#: below this many gates the kernels loop over gates (a vectorised loop over a few gates costs
#: more than it saves), from it by tiles of gates
_TILES_MIN_GATES = 16


@njit(cache=True, nogil=True)
def gate_forward(
    logits: Any,
    k: int,
    gam: Any,
    lam: Any,
    divisor: float,
    tiny: float,
    out: Any,
    state: Any,
) -> float:  # pragma: no cover - compiled
    """Weights ``out`` (G, N) of the gates' logits (G, K(1+M)) and the state (G, 2K + K·M):
    per gate the K entropies, σ(α) and log(1 - p) - log p of each bit (for the backward).
    Returns the loss Σ_g λ_g Σ_i h_gi / divisor (float64). γ (P,) and λ (Q,) hold one value or
    one per gate: gate g reads entry g mod P (g mod Q), the last axis of the gates' layout.
    ``tiny``: the dtype's smallest normal number (the logs' clamp)."""
    if logits.shape[0] < _TILES_MIN_GATES:
        return _forward_gates(logits, k, gam, lam, divisor, tiny, out, state)
    return _forward_tiles(logits, k, gam, lam, divisor, tiny, out, state)


@njit(cache=True, nogil=True)
def gate_backward(
    logits: Any,
    k: int,
    gam: Any,
    state: Any,
    g_out: Any,
    has_out: bool,
    g_ent: Any,
    g_scale: float,
    grad: Any,
) -> None:  # pragma: no cover - compiled
    """The grad of the logits ``grad`` (G, K(1+M)) from the grad of the weights ``g_out``
    (G, N; read only with ``has_out``) and of the entropies, ``g_scale`` · ``g_ent``
    (float64 (R, C), broadcast: selector (g, i) reads entry (g mod R, i mod C)); ``state``
    as :func:`gate_forward` left it."""
    if logits.shape[0] < _TILES_MIN_GATES:
        _backward_gates(logits, k, gam, state, g_out, has_out, g_ent, g_scale, grad)
    else:
        _backward_tiles(logits, k, gam, state, g_out, has_out, g_ent, g_scale, grad)
