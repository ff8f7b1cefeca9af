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
from numba import njit, types
from numba.extending import intrinsic, overload

__all__: list[str] = []

# One file on purpose: numba's on-disk cache of a function is keyed on its own source file
# only, so a kernel that called jitted code of another file would keep running the old
# compiled code of that file after it changed (tests/test_architecture.py lists the reason).

# -- operations that keep loops vectorisable ---------------------------------------------------
#
# A branch-free select (an LLVM ``select``: numba compiles ``a if c else b`` to a branch, which
# mispredicts on mixed data and stops LLVM's loop vectoriser), and the float32 log in plain
# arithmetic and bit operations (libm's ``logf`` is a call per number); ``_log`` picks it for
# float32 and libm's log for float64.


def _f32_bits_typing(typingctx: Any, x: Any) -> Any:  # pragma: no cover - compiled
    """The bits of a float32 as an int32 (an LLVM bitcast)."""
    if x != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(types.int32))

    return types.int32(types.float32), codegen


def _bits_f32_typing(typingctx: Any, x: Any) -> Any:  # pragma: no cover - compiled
    """The float32 whose bits are the low 32 bits of an int32 or int64 (an LLVM bitcast)."""
    if x not in (types.int32, types.int64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v = args[0]
        if x == types.int64:
            v = builder.trunc(v, context.get_value_type(types.int32))
        return builder.bitcast(v, context.get_value_type(types.float32))

    return types.float32(x), codegen


def _lt_select_typing(typingctx: Any, x: Any, y: Any, a: Any, b: Any) -> Any:
    """``a if x < y else b`` without a branch (an LLVM fcmp and select: loops over it vectorise;
    a NaN x or y gives b)."""
    if not (isinstance(x, types.Float) and x == y == a == b):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.select(builder.fcmp_ordered("<", args[0], args[1]), args[2], args[3])

    return x(x, x, x, x), codegen


_lt_select: Any = intrinsic(_lt_select_typing)
_f32_bits: Any = intrinsic(_f32_bits_typing)
_bits_f32: Any = intrinsic(_bits_f32_typing)


@njit(cache=True, nogil=True, inline="always")
def _logf(x: Any) -> Any:  # pragma: no cover - compiled
    """log of a positive normal float32: Cephes' ``logf`` (frexp, a degree-9 polynomial on
    [√½ - 1, √2 - 1]; within 1 ulp of the correctly rounded log, tested), in plain arithmetic
    and bit operations, so loops over it vectorise (libm's ``logf`` is a call per number)."""
    b = _f32_bits(x)
    e = (b >> 23) - 126  # x = m 2**e, m in [1/2, 1)
    m = _bits_f32((b & 0x007FFFFF) | 0x3F000000)
    small = np.float32(m < np.float32(0.70710678118654752))  # then m 2**e = (2m) 2**(e-1)
    e = np.float32(e) - small
    m = m + m * small - np.float32(1.0)
    z = m * m
    y = np.float32(7.0376836292e-2)
    y = y * m + np.float32(-1.1514610310e-1)
    y = y * m + np.float32(1.1676998740e-1)
    y = y * m + np.float32(-1.2420140846e-1)
    y = y * m + np.float32(1.4249322787e-1)
    y = y * m + np.float32(-1.6668057665e-1)
    y = y * m + np.float32(2.0000714765e-1)
    y = y * m + np.float32(-2.4999993993e-1)
    y = y * m + np.float32(3.3333331174e-1)
    y = y * m * z
    y = y + e * np.float32(-2.12194440e-4)
    y = y - np.float32(0.5) * z
    return m + y + e * np.float32(0.693359375)


def _log(x: Any) -> Any:
    """log x for x >= the dtype's smallest normal number (typed per dtype below)."""
    return np.log(x)


@overload(_log, inline="always")
def _log_typed(x: Any) -> Any:  # pragma: no cover - compiled
    if x == types.float32:

        def impl(x: Any) -> Any:
            return _logf(x)

    else:

        def impl(x: Any) -> Any:
            return np.log(x)

    return impl


# -- by gates ------------------------------------------------------------------------------------


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
