"""The numba kernels of :mod:`dselectk._numba` by tiles of gates (from ``_TILES_MIN_GATES`` on).

Imports numba, numpy and :mod:`dselectk._numba_ops` only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from dselectk._numba_ops import _log, _lt_select

__all__: list[str] = []


# -- by tiles of gates ---------------------------------------------------------------------------
#
# The same arithmetic on up to _TILE gates at a time, each quantity laid out (..., gate): every
# loop's innermost axis is the tile's gates, so LLVM vectorises it (the per-gate loops of _numba run
# over 2**bits <= 16 entries or M bits, too short for that). The tile's logits are transposed in,
# the weights and the state out. Comparisons are branch-free selects (_lt_select): with bits both
# saturated and not, branches mispredict (measured: 2x the forward's time).

#: gates per tile (a loop of 64 is not unrolled away before LLVM's loop vectoriser sees it)
_TILE = 64


@njit(cache=True, nogil=True)
def _forward_tiles(
    logits: Any,
    k: int,
    gam: Any,
    lam: Any,
    divisor: float,
    tiny: float,
    out: Any,
    state: Any,
) -> float:  # pragma: no cover - compiled
    """:func:`gate_forward` by tiles of up to ``_TILE`` gates, the gates innermost."""
    g_count, c = logits.shape
    m = c // k - 1
    km = k * m
    n = 1 << m
    m_lo = (m + 1) // 2
    m_hi = m - m_lo
    n_lo = 1 << m_lo
    n_hi = 1 << m_hi
    dt = logits.dtype.type
    tiny_t = dt(tiny)
    one = dt(1.0)
    half = dt(0.5)
    c15 = dt(1.5)
    c2_ = dt(-2.0)
    zero = dt(0.0)
    x = np.empty((c, _TILE), logits.dtype)
    gt = np.empty(_TILE, logits.dtype)
    a = np.empty((k, _TILE), logits.dtype)
    mx = np.empty(_TILE, logits.dtype)
    tot = np.empty(_TILE, logits.dtype)
    p = np.empty((km, _TILE), logits.dtype)
    q = np.empty((km, _TILE), logits.dtype)
    h = np.empty((km, _TILE), logits.dtype)
    dent = np.empty((km, _TILE), logits.dtype)
    ent = np.empty((k, _TILE), logits.dtype)
    lo = np.empty((k * n_lo, _TILE), logits.dtype)
    hi = np.empty((k * n_hi, _TILE), logits.dtype)
    o = np.empty((n, _TILE), logits.dtype)
    loss = 0.0
    for g0 in range(0, g_count, _TILE):
        nv = min(_TILE, g_count - g0)
        for t in range(nv):
            for cc in range(c):
                x[cc, t] = logits[g0 + t, cc]
            gt[t] = gam[(g0 + t) % gam.size]
        # softmax over the K selectors
        for t in range(nv):
            mx[t] = x[0, t]
        for i in range(1, k):
            for t in range(nv):
                v = x[i, t]
                mx[t] = _lt_select(mx[t], v, v, mx[t])
        for t in range(nv):
            tot[t] = zero
        for i in range(k):
            for t in range(nv):
                e = np.exp(x[i, t] - mx[t])
                a[i, t] = e
                tot[t] += e
        for i in range(k):
            for t in range(nv):
                a[i, t] = a[i, t] / tot[t]
        # bits, logs, entropies
        for j in range(km):
            for t in range(nv):
                v = x[k + j, t] / gt[t]
                v = _lt_select(v, -half, -half, v)
                v = _lt_select(half, v, half, v)
                pj = v * v
                pj = pj * c2_
                pj = pj + c15
                pj = pj * v
                pj = pj + half
                p[j, t] = pj
                q[j, t] = one - pj
            for t in range(nv):
                pj = p[j, t]
                log_p = _log(_lt_select(pj, tiny_t, tiny_t, pj))
                h[j, t] = pj * log_p
                dent[j, t] = -log_p
            for t in range(nv):
                qj = q[j, t]
                log_q = _log(_lt_select(qj, tiny_t, tiny_t, qj))
                h[j, t] += qj * log_q
                dent[j, t] += log_q
        for i in range(k):
            for t in range(nv):
                ent[i, t] = zero
            for j in range(i * m, (i + 1) * m):
                for t in range(nv):
                    ent[i, t] += h[j, t]
            for t in range(nv):
                ent[i, t] = -ent[i, t]
        # the halves' laws by doubling, σ(α) into the high half
        for i in range(k):
            b0 = i * n_lo
            for t in range(nv):
                lo[b0, t] = one
            w = 1
            for jj in range(m_lo):
                j = i * m + jj
                for cc in range(w - 1, -1, -1):
                    for t in range(nv):
                        v = lo[b0 + cc, t]
                        lo[b0 + cc + w, t] = v * p[j, t]
                        lo[b0 + cc, t] = v * q[j, t]
                w *= 2
            b0 = i * n_hi
            for t in range(nv):
                hi[b0, t] = one
            w = 1
            for jj in range(m_hi):
                j = i * m + m_lo + jj
                for cc in range(w - 1, -1, -1):
                    for t in range(nv):
                        v = hi[b0 + cc, t]
                        hi[b0 + cc + w, t] = v * p[j, t]
                        hi[b0 + cc, t] = v * q[j, t]
                w *= 2
            for cc in range(n_hi):  # σ(α)_i last, as the per-gate loops multiply it
                for t in range(nv):
                    hi[b0 + cc, t] = a[i, t] * hi[b0 + cc, t]
        # the weights: Σ_i hi_i ⊗ lo_i, code = high · L + low
        for c1 in range(n_hi):
            for c2 in range(n_lo):
                cc = c1 * n_lo + c2
                for t in range(nv):
                    o[cc, t] = hi[c1, t] * lo[c2, t]
                for i in range(1, k):
                    for t in range(nv):
                        o[cc, t] += hi[i * n_hi + c1, t] * lo[i * n_lo + c2, t]
        for t in range(nv):
            g = g0 + t
            for cc in range(n):
                out[g, cc] = o[cc, t]
            total = 0.0
            for i in range(k):
                state[g, i] = ent[i, t]
                state[g, k + i] = a[i, t]
                total += ent[i, t]
            for j in range(km):
                state[g, 2 * k + j] = dent[j, t]
            loss += lam[g % lam.size] * total
    return loss / divisor


@njit(cache=True, nogil=True)
def _backward_tiles(
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
    """:func:`gate_backward` by tiles of up to ``_TILE`` gates, the gates innermost."""
    g_count, c = logits.shape
    m = c // k - 1
    km = k * m
    n = 1 << m
    m_lo = (m + 1) // 2
    m_hi = m - m_lo
    n_lo = 1 << m_lo
    n_hi = 1 << m_hi
    dt = logits.dtype.type
    one = dt(1.0)
    half = dt(0.5)
    c15 = dt(1.5)
    c2_ = dt(-2.0)
    c6 = dt(-6.0)
    zero = dt(0.0)
    rows, cols = g_ent.shape
    x = np.empty((c, _TILE), logits.dtype)
    gt = np.empty(_TILE, logits.dtype)
    a = np.zeros((k, _TILE), logits.dtype)
    dent = np.zeros((km, _TILE), logits.dtype)
    s = np.empty((km, _TILE), logits.dtype)
    p = np.empty((km, _TILE), logits.dtype)
    q = np.empty((km, _TILE), logits.dtype)
    g_p = np.empty((km, _TILE), logits.dtype)
    ge = np.zeros((k, _TILE), np.float64)
    g_a = np.empty((k, _TILE), logits.dtype)
    gt_out = np.zeros((n, _TILE), logits.dtype)
    lev_lo = np.empty((k * 2 * n_lo, _TILE), logits.dtype)
    lev_hi = np.empty((k * 2 * n_hi, _TILE), logits.dtype)
    g_lo = np.empty((k * n_lo, _TILE), logits.dtype)
    g_hi = np.empty((k * n_hi, _TILE), logits.dtype)
    acc = np.empty(_TILE, logits.dtype)
    w_hi = np.empty(_TILE, logits.dtype)
    dot = np.empty(_TILE, logits.dtype)
    for g0 in range(0, g_count, _TILE):
        nv = min(_TILE, g_count - g0)
        for t in range(nv):
            g = g0 + t
            for cc in range(c):
                x[cc, t] = logits[g, cc]
            gt[t] = gam[g % gam.size]
            for i in range(k):
                a[i, t] = state[g, k + i]
                ge[i, t] = g_scale * g_ent[g % rows, i % cols]
            for j in range(km):
                dent[j, t] = state[g, 2 * k + j]
            if has_out:
                for cc in range(n):
                    gt_out[cc, t] = g_out[g, cc]
        for j in range(km):
            for t in range(nv):
                v = x[k + j, t] / gt[t]
                v = _lt_select(v, -half, -half, v)
                v = _lt_select(half, v, half, v)
                s[j, t] = v
                pj = v * v
                pj = pj * c2_
                pj = pj + c15
                pj = pj * v
                pj = pj + half
                p[j, t] = pj
                q[j, t] = one - pj
        if has_out:
            # the levels of both halves' doublings (level r of 2**r entries at rows 2**r ..)
            for i in range(k):
                b0 = i * 2 * n_lo
                for t in range(nv):
                    lev_lo[b0 + 1, t] = one
                w = 1
                for jj in range(m_lo):
                    j = i * m + jj
                    for cc in range(w):
                        for t in range(nv):
                            v = lev_lo[b0 + w + cc, t]
                            lev_lo[b0 + 2 * w + cc, t] = v * q[j, t]
                            lev_lo[b0 + 3 * w + cc, t] = v * p[j, t]
                    w *= 2
                b0 = i * 2 * n_hi
                for t in range(nv):
                    lev_hi[b0 + 1, t] = one
                w = 1
                for jj in range(m_hi):
                    j = i * m + m_lo + jj
                    for cc in range(w):
                        for t in range(nv):
                            v = lev_hi[b0 + w + cc, t]
                            lev_hi[b0 + 2 * w + cc, t] = v * q[j, t]
                            lev_hi[b0 + 3 * w + cc, t] = v * p[j, t]
                    w *= 2
            # g_hi_i[h] = Σ_l g[h, l] lo_i[l]; g_lo_i[l] = Σ_h g[h, l] σ(α)_i hi_i[h]
            for i in range(k):
                blo = i * 2 * n_lo + n_lo
                bhi = i * 2 * n_hi + n_hi
                for c2 in range(n_lo):
                    for t in range(nv):
                        g_lo[i * n_lo + c2, t] = zero
                for c1 in range(n_hi):
                    for t in range(nv):
                        acc[t] = zero
                        w_hi[t] = a[i, t] * lev_hi[bhi + c1, t]
                    for c2 in range(n_lo):
                        for t in range(nv):
                            gv = gt_out[c1 * n_lo + c2, t]
                            acc[t] += gv * lev_lo[blo + c2, t]
                            g_lo[i * n_lo + c2, t] += gv * w_hi[t]
                    for t in range(nv):
                        g_hi[i * n_hi + c1, t] = acc[t]
                for t in range(nv):
                    acc[t] = zero
                for c1 in range(n_hi):
                    for t in range(nv):
                        acc[t] += g_hi[i * n_hi + c1, t] * lev_hi[bhi + c1, t]
                        g_hi[i * n_hi + c1, t] *= a[i, t]
                for t in range(nv):
                    g_a[i, t] = acc[t]
                # walk both doublings back: d/dp_j and the grad of the level below
                for half_ in range(2):
                    if half_ == 0:
                        bits, j0, lev, b0, gl, gb = (
                            m_lo,
                            i * m,
                            lev_lo,
                            i * 2 * n_lo,
                            g_lo,
                            i * n_lo,
                        )
                    else:
                        bits, j0, lev, b0, gl, gb = (
                            m_hi,
                            i * m + m_lo,
                            lev_hi,
                            i * 2 * n_hi,
                            g_hi,
                            i * n_hi,
                        )
                    for r in range(bits - 1, -1, -1):
                        w = 1 << r
                        j = j0 + r
                        for t in range(nv):
                            acc[t] = zero
                        for cc in range(w):
                            for t in range(nv):
                                g0_ = gl[gb + cc, t]
                                g1_ = gl[gb + cc + w, t]
                                acc[t] += (g1_ - g0_) * lev[b0 + w + cc, t]
                                gl[gb + cc, t] = g0_ * q[j, t] + g1_ * p[j, t]
                        for t in range(nv):
                            g_p[j, t] = acc[t]
        else:
            for i in range(k):
                for t in range(nv):
                    g_a[i, t] = zero
            for j in range(km):
                for t in range(nv):
                    g_p[j, t] = zero
        for t in range(nv):
            dot[t] = zero
        for i in range(k):
            for t in range(nv):
                dot[t] += g_a[i, t] * a[i, t]
        for i in range(k):
            for t in range(nv):
                g_a[i, t] = a[i, t] * (g_a[i, t] - dot[t])  # softmax backward
            for jj in range(m):
                j = i * m + jj
                for t in range(nv):  # d h(p) / dp = log(1 - p) - log p (clamped logs)
                    gpj = dt(g_p[j, t] + ge[i, t] * dent[j, t])
                    d = s[j, t] * s[j, t]
                    d = d * c6
                    d = d + c15
                    d = d * gpj
                    g_p[j, t] = d / gt[t]
        for t in range(nv):
            g = g0 + t
            for i in range(k):
                grad[g, i] = g_a[i, t]
            for j in range(km):
                grad[g, k + j] = g_p[j, t]
