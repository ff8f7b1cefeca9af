"""Compiled CPU kernels of the DSelect-k gate (numba; the ``fast`` extra).

Imported by :mod:`dselectk.kernels.setting` only when the numba kernel is in use (see there:
the ``DSELECTK_KERNEL`` variable); importing this module imports numba. One forward and one
backward over a gate's logits (G, K(1+M)) (α the first K columns, then Z (K, M)), one thread,
without the GIL, float32 and float64 (one compiled specialisation each, on first use).

Per selector i of gate g, with p_j = S(z_ij / γ) (the smooth-step, op for op as the ATen
kernels write it) and q_j = 1 - p_j, the law r(p) over the N = 2**M codes (bit j worth 2**j) is
the outer product of the laws of the low M_lo = ceil(M/2) bits (L = 2**M_lo codes) and of the
high bits (H = N / L), each built by doubling: from [1], for each bit the entries v so far
become (v q_j, v p_j) (level r: the law of the first r bits). The gate's weights are
Σ_i (σ(α)_i hi_i) ⊗ lo_i (code = high · L + low), K·N multiply-adds, no (K, N) tensor. The
entropy is Σ_j h(p_j) with clamped logs (as :func:`dselectk.functional.binary_entropy`); the
loss λ Σ_i h_i per gate is summed over the gates in float64 and divided by ``divisor``.

The backward recomputes the halves' levels and walks them back: with G the grad of level r + 1,
d/dp = Σ_c (G[c + 2**r] - G[c]) level_r[c] and the grad of level r is G[c] q + G[c + 2**r] p;
the halves' grads are g_hi_i = g lo_i and g_lo_i = gᵀ (σ(α)_i hi_i), with g the (H, L) grad of
the gate's row. No division anywhere: exact at binary bits (zero factors). The grad of σ(α)_i is
⟨g_hi_i, hi_i⟩, the softmax backward gives α's, and dS/dz = (1.5 - 6 s²)/γ (exactly 0 at the
clamp) z's.

Both work by tiles of gates, every quantity laid out (..., gate) so that each loop's innermost
axis is the tile's gates, which LLVM vectorises: tiles of ``_TILE`` gates (a compile-time
trip count: no scalar remainder loops) while as many remain, then one narrow tile of the rest,
whose (N, K) products go gate by gate (a loop over a few gates per product costs more than it
saves). The forward keeps per gate σ(α), the clamped z/γ and log(1 - p) - log p of each bit
for the backward in a ``state`` laid out (row, gate) (:func:`state_shape`), which the backward
reads with vector loads. Comparisons are branch-free selects and the float32 log is Cephes'
``logf`` in plain arithmetic (:func:`_logf`), so those loops vectorise too; float64 uses libm's
log; and ``error_model="numpy"``: no zero check per division (python's raises
ZeroDivisionError, a branch that keeps the divisions' loops scalar; here γ > 0 and the
softmax's sum >= 1). The numbers do not depend on the tiling (no fused multiply-adds, the same
order of operations for every gate; tested).
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


def _cache_probe() -> None:  # pragma: no cover - never called
    """A function numba is asked to cache, to learn whether it can cache this file's."""


# numba raises "cannot cache function ..." when a function with ``cache=True`` is defined and no
# cache folder is writable (NUMBA_CACHE_DIR, this file's folder, the user's cache folder; e.g. a
# read-only install run by a user without a writable home). Then the kernels compile in memory
# in each process instead (``dselectk.kernels.setting`` warns once): a computation never fails
# for want of a cache.
try:
    njit(cache=True)(_cache_probe)
    CACHE = True
except RuntimeError:
    CACHE = False


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


@njit(cache=CACHE, nogil=True, error_model="numpy", inline="always")
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


# -- by tiles of gates ---------------------------------------------------------------------------

#: gates per wide tile (a loop of 64 is not unrolled away before LLVM's loop vectoriser sees it)
_TILE = 64
#: from this many gates on, the rest after the last full wide tile takes a wide tile padded with
#: zero logits (as cheap as a narrow one at 16 gates, cheaper from there on; measured)
_PAD_FROM = 16


def state_shape(gates: int, k: int, m: int) -> tuple[int, int]:
    """The shape of the kernels' ``state`` for ``gates`` gates of K selectors over M bits:
    (K(1 + 2M) rows, per gate σ(α), the clamped z/γ and log(1 - p) - log p; the gates and the
    padding of a last wide tile)."""
    rest = gates % _TILE
    return k * (1 + 2 * m), gates + (_TILE - rest if rest >= _PAD_FROM else 0)


@njit(cache=CACHE, nogil=True, error_model="numpy", inline="always")
def _levels(
    p: Any, q: Any, j0: int, bits: int, lev: Any, b0: int, tw: int
) -> None:  # pragma: no cover - compiled
    """The levels of the doubling of bits j0 .. j0 + bits - 1 of the tile (``p``, ``q`` (bit,
    gate)): level r (the law of the first r of them, 2**r rows) at rows b0 + 2**r of ``lev``;
    the last level is the law itself."""
    one = lev.dtype.type(1.0)
    for t in range(tw):
        lev[b0 + 1, t] = one
    w = 1
    for r in range(bits):
        j = j0 + r
        for cc in range(w):
            for t in range(tw):
                v = lev[b0 + w + cc, t]
                lev[b0 + 2 * w + cc, t] = v * q[j, t]
                lev[b0 + 3 * w + cc, t] = v * p[j, t]
        w *= 2


@njit(cache=CACHE, nogil=True, error_model="numpy", inline="always")
def _walk_back(
    p: Any,
    q: Any,
    j0: int,
    bits: int,
    lev: Any,
    b0: int,
    gl: Any,
    gb: int,
    acc: Any,
    g_p: Any,
    tw: int,
) -> None:  # pragma: no cover - compiled
    """Walk :func:`_levels` back: rows gb .. of ``gl`` hold the grad of the law (overwritten);
    the grads of p_j0 .. p_(j0 + bits - 1) go to ``g_p``."""
    zero = gl.dtype.type(0.0)
    for r in range(bits - 1, -1, -1):
        w = 1 << r
        j = j0 + r
        for t in range(tw):
            acc[t] = zero
        for cc in range(w):
            for t in range(tw):
                g0 = gl[gb + cc, t]
                g1 = gl[gb + cc + w, t]
                acc[t] += (g1 - g0) * lev[b0 + w + cc, t]
                gl[gb + cc, t] = g0 * q[j, t] + g1 * p[j, t]
        for t in range(tw):
            g_p[j, t] = acc[t]


@njit(cache=CACHE, nogil=True, error_model="numpy", inline="always")
def _smooth(state: Any, g0: int, k: int, km: int, p: Any, q: Any, tw: int) -> None:
    """p = S(z) = s (1.5 - 2 s²) + 0.5 and q = 1 - p of the tile's bits from s = the clamped
    z/γ (rows k .. of ``state``, gates from ``g0``), op for op as the ATen and NumPy kernels
    (NaN stays NaN)."""
    dt = state.dtype.type
    one, half, c15, c2 = dt(1.0), dt(0.5), dt(1.5), dt(-2.0)
    for j in range(km):
        for t in range(tw):
            v = state[k + j, g0 + t]
            pj = v * v
            pj = pj * c2
            pj = pj + c15
            pj = pj * v
            pj = pj + half
            p[j, t] = pj
            q[j, t] = one - pj


@njit(cache=CACHE, nogil=True, error_model="numpy", inline="always")
def _gate_values(vals: Any, g0: int, into: Any, tw: int) -> None:
    """``into[t]`` = vals[(g0 + t) mod P] (γ or λ: one value or one per gate, P = vals.size)."""
    j = g0 % vals.size
    for t in range(tw):
        into[t] = vals[j]
        j = j + 1 if j + 1 < vals.size else 0


@njit(cache=CACHE, nogil=True, error_model="numpy", inline="always")
def _forward_tile(
    logits: Any,
    k: int,
    gam: Any,
    lam: Any,
    tiny: float,
    out: Any,
    state: Any,
    g0: int,
    tw: int,
    wide: bool,
    loss: float,
    x: Any,
    p: Any,
    q: Any,
    h: Any,
    lev_lo: Any,
    lev_hi: Any,
    o: Any,
    v: Any,
    v64: Any,
) -> float:  # pragma: no cover - compiled
    """:func:`gate_forward` on the ``tw`` gates from ``g0`` (``wide``: a tile of ``_TILE``, a
    constant at its call site; else the rest, a narrow tile); returns ``loss`` plus their
    λ_g Σ_i h_gi (float64, gate after gate)."""
    c = logits.shape[1]
    m = c // k - 1
    km = k * m
    n = 1 << m
    m_lo = (m + 1) // 2
    n_lo, n_hi = 1 << m_lo, 1 << (m - m_lo)
    dt = logits.dtype.type
    tiny_t, half, zero = dt(tiny), dt(0.5), dt(0.0)
    # state[:, g0 + t]: σ(α) (K rows), s (K·M), log(1 - p) - log p (K·M) of gate g0 + t
    gt, mx, tot = v[0], v[1], v[2]
    nv = min(tw, logits.shape[0] - g0)  # (a padded wide tile: zero logits from nv on)
    for t in range(nv):
        for cc in range(c):
            x[cc, t] = logits[g0 + t, cc]
    for cc in range(c):
        for t in range(nv, tw):
            x[cc, t] = zero
    _gate_values(gam, g0, gt, tw)
    # softmax over the K selectors
    for t in range(tw):
        mx[t] = x[0, t]
    for i in range(1, k):
        for t in range(tw):
            mx[t] = _lt_select(mx[t], x[i, t], x[i, t], mx[t])
    for t in range(tw):
        tot[t] = zero
    for i in range(k):
        for t in range(tw):
            e = np.exp(x[i, t] - mx[t])
            state[i, g0 + t] = e
            tot[t] += e
    for i in range(k):
        for t in range(tw):
            state[i, g0 + t] = state[i, g0 + t] / tot[t]
    # bits (s = clamp(z / γ, ±1/2)), logs, entropies
    for j in range(km):
        for t in range(tw):
            s = x[k + j, t] / gt[t]
            s = _lt_select(s, -half, -half, s)
            state[k + j, g0 + t] = _lt_select(half, s, half, s)
    _smooth(state, g0, k, km, p, q, tw)
    for j in range(km):
        for t in range(tw):
            pj = p[j, t]
            log_p = _log(_lt_select(pj, tiny_t, tiny_t, pj))
            h[j, t] = pj * log_p
            state[k + km + j, g0 + t] = -log_p
        for t in range(tw):
            qj = q[j, t]
            log_q = _log(_lt_select(qj, tiny_t, tiny_t, qj))
            h[j, t] += qj * log_q
            state[k + km + j, g0 + t] += log_q
    for t in range(tw):
        v64[t] = 0.0
    for i in range(k):
        for t in range(tw):
            tot[t] = zero
        for j in range(i * m, (i + 1) * m):
            for t in range(tw):
                tot[t] += h[j, t]
        for t in range(tw):
            v64[t] += -tot[t]
    # the halves' laws by doubling, σ(α) into the high half's
    for i in range(k):
        _levels(p, q, i * m, m_lo, lev_lo, i * 2 * n_lo, tw)
        _levels(p, q, i * m + m_lo, m - m_lo, lev_hi, i * 2 * n_hi, tw)
        b = i * 2 * n_hi + n_hi
        for cc in range(n_hi):
            for t in range(tw):
                lev_hi[b + cc, t] = state[i, g0 + t] * lev_hi[b + cc, t]
    # the weights: Σ_i hi_i ⊗ lo_i, code = high · L + low (a wide tile's gates innermost, then
    # transposed out; a narrow one's gate by gate, without a loop over a few gates per product)
    if wide:
        for c1 in range(n_hi):
            for c2 in range(n_lo):
                cc = c1 * n_lo + c2
                for t in range(tw):
                    o[cc, t] = lev_hi[n_hi + c1, t] * lev_lo[n_lo + c2, t]
                for i in range(1, k):
                    b_hi, b_lo = i * 2 * n_hi + n_hi + c1, i * 2 * n_lo + n_lo + c2
                    for t in range(tw):
                        o[cc, t] += lev_hi[b_hi, t] * lev_lo[b_lo, t]
        for t in range(nv):
            for cc in range(n):
                out[g0 + t, cc] = o[cc, t]
    else:
        for t in range(tw):
            row = out[g0 + t]
            for c1 in range(n_hi):
                v_hi = lev_hi[n_hi + c1, t]
                for c2 in range(n_lo):
                    row[c1 * n_lo + c2] = v_hi * lev_lo[n_lo + c2, t]
                for i in range(1, k):
                    v_hi = lev_hi[i * 2 * n_hi + n_hi + c1, t]
                    for c2 in range(n_lo):
                        row[c1 * n_lo + c2] += v_hi * lev_lo[i * 2 * n_lo + n_lo + c2, t]
    j = g0 % lam.size
    for t in range(nv):
        loss += lam[j] * v64[t]
        j = j + 1 if j + 1 < lam.size else 0
    return loss


@njit(cache=CACHE, nogil=True, error_model="numpy", inline="always")
def _backward_tile(
    k: int,
    gam: Any,
    state: Any,
    g_out: Any,
    has_out: bool,
    g_ent: Any,
    g_scale: float,
    grad: Any,
    g0: int,
    tw: int,
    wide: bool,
    p: Any,
    q: Any,
    g_p: Any,
    ge: Any,
    g_a: Any,
    gto: Any,
    lev_lo: Any,
    lev_hi: Any,
    g_lo: Any,
    g_hi: Any,
    v: Any,
) -> None:  # pragma: no cover - compiled
    """:func:`gate_backward` on the ``tw`` gates from ``g0`` (``wide`` as in the forward)."""
    c = grad.shape[1]
    m = c // k - 1
    km = k * m
    n = 1 << m
    m_lo = (m + 1) // 2
    n_lo, n_hi = 1 << m_lo, 1 << (m - m_lo)
    dt = grad.dtype.type
    c15, c6, zero = dt(1.5), dt(-6.0), dt(0.0)
    gt, acc, w_hi = v[0], v[1], v[2]
    nv = min(tw, grad.shape[0] - g0)  # (a padded wide tile: gates from nv on are not written)
    _gate_values(gam, g0, gt, tw)
    rows, cols = g_ent.shape
    for i in range(k):
        r, col = g0 % rows, i % cols
        for t in range(tw):
            ge[i, t] = g_scale * g_ent[r, col]
            r = r + 1 if r + 1 < rows else 0
    _smooth(state, g0, k, km, p, q, tw)
    if has_out:
        if wide:  # (a narrow tile's products go gate by gate, see the forward)
            for t in range(nv):
                for cc in range(n):
                    gto[cc, t] = g_out[g0 + t, cc]
            for cc in range(n):
                for t in range(nv, tw):
                    gto[cc, t] = zero
        for i in range(k):
            blo, bhi = i * 2 * n_lo, i * 2 * n_hi
            _levels(p, q, i * m, m_lo, lev_lo, blo, tw)
            _levels(p, q, i * m + m_lo, m - m_lo, lev_hi, bhi, tw)
            # g_hi_i[h] = Σ_l g[h, l] lo_i[l]; g_lo_i[l] = Σ_h g[h, l] σ(α)_i hi_i[h]
            for c2 in range(n_lo):
                for t in range(tw):
                    g_lo[c2, t] = zero
            if wide:
                for c1 in range(n_hi):
                    for t in range(tw):
                        acc[t] = zero
                        w_hi[t] = state[i, g0 + t] * lev_hi[bhi + n_hi + c1, t]
                    for c2 in range(n_lo):
                        for t in range(tw):
                            gv = gto[c1 * n_lo + c2, t]
                            acc[t] += gv * lev_lo[blo + n_lo + c2, t]
                            g_lo[c2, t] += gv * w_hi[t]
                    for t in range(tw):
                        g_hi[c1, t] = acc[t]
            else:
                for t in range(tw):
                    row = g_out[g0 + t]
                    for c1 in range(n_hi):
                        a_t = zero
                        w_t = state[i, g0 + t] * lev_hi[bhi + n_hi + c1, t]
                        for c2 in range(n_lo):
                            gv = row[c1 * n_lo + c2]
                            a_t += gv * lev_lo[blo + n_lo + c2, t]
                            g_lo[c2, t] += gv * w_t
                        g_hi[c1, t] = a_t
            for t in range(tw):
                acc[t] = zero
            for c1 in range(n_hi):
                for t in range(tw):
                    acc[t] += g_hi[c1, t] * lev_hi[bhi + n_hi + c1, t]
                    g_hi[c1, t] *= state[i, g0 + t]
            for t in range(tw):
                g_a[i, t] = acc[t]
            # walk both doublings back: d/dp_j and the grad of the level below
            _walk_back(p, q, i * m, m_lo, lev_lo, blo, g_lo, 0, acc, g_p, tw)
            _walk_back(p, q, i * m + m_lo, m - m_lo, lev_hi, bhi, g_hi, 0, acc, g_p, tw)
    else:
        for i in range(k):
            for t in range(tw):
                g_a[i, t] = zero
        for j in range(km):
            for t in range(tw):
                g_p[j, t] = zero
    for t in range(tw):
        acc[t] = zero
    for i in range(k):
        for t in range(tw):
            acc[t] += g_a[i, t] * state[i, g0 + t]
    for i in range(k):
        for t in range(tw):
            g_a[i, t] = state[i, g0 + t] * (g_a[i, t] - acc[t])  # softmax backward
        for j in range(i * m, (i + 1) * m):
            for t in range(tw):  # d h(p) / dp = log(1 - p) - log p (clamped logs)
                gpj = dt(g_p[j, t] + ge[i, t] * state[k + km + j, g0 + t])  # (+ 0 without: exact)
                s = state[k + j, g0 + t]
                d = s * s
                d = d * c6
                d = d + c15
                d = d * gpj
                g_p[j, t] = d / gt[t]
    for t in range(nv):
        for i in range(k):
            grad[g0 + t, i] = g_a[i, t]
        for j in range(km):
            grad[g0 + t, k + j] = g_p[j, t]


@njit(cache=CACHE, nogil=True, error_model="numpy")
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
    """Weights ``out`` (G, N) of the gates' logits (G, K(1+M)) and the ``state``
    (:func:`state_shape`) for the backward. Returns the loss Σ_g λ_g Σ_i h_gi / divisor
    (float64). γ (P,) and λ (Q,) hold one value or one per gate: gate g reads entry g mod P
    (g mod Q), the last axis of the gates' layout. ``tiny``: the dtype's smallest normal number
    (the logs' clamp)."""
    g_count, c = logits.shape
    m = c // k - 1
    km = k * m
    m_lo = (m + 1) // 2
    n_lo, n_hi = 1 << m_lo, 1 << (m - m_lo)
    w = _TILE if g_count >= _PAD_FROM else g_count
    dt = logits.dtype
    x = np.empty((c, w), dt)
    p, q, h = np.empty((km, w), dt), np.empty((km, w), dt), np.empty((km, w), dt)
    lev_lo, lev_hi = np.empty((k * 2 * n_lo, w), dt), np.empty((k * 2 * n_hi, w), dt)
    o, v, v64 = np.empty((1 << m, w), dt), np.empty((3, w), dt), np.empty(w, np.float64)
    loss = 0.0
    g0 = 0
    while g0 < g_count:
        if g_count - g0 >= _PAD_FROM:
            loss = _forward_tile(
                logits, k, gam, lam, tiny, out, state, g0, _TILE, True, loss,
                x, p, q, h, lev_lo, lev_hi, o, v, v64,
            )  # fmt: skip
            g0 += _TILE
        else:
            loss = _forward_tile(
                logits, k, gam, lam, tiny, out, state, g0, g_count - g0, False, loss,
                x, p, q, h, lev_lo, lev_hi, o, v, v64,
            )  # fmt: skip
            g0 = g_count
    return loss / divisor


@njit(cache=CACHE, nogil=True, error_model="numpy")
def gate_backward(
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
    g_count, c = grad.shape
    m = c // k - 1
    km = k * m
    m_lo = (m + 1) // 2
    n_lo, n_hi = 1 << m_lo, 1 << (m - m_lo)
    w = _TILE if g_count >= _PAD_FROM else g_count
    dt = grad.dtype
    p, q, g_p = np.empty((km, w), dt), np.empty((km, w), dt), np.empty((km, w), dt)
    ge, g_a = np.empty((k, w), np.float64), np.empty((k, w), dt)
    gto = np.empty((1 << m, w), dt)
    lev_lo, lev_hi = np.empty((k * 2 * n_lo, w), dt), np.empty((k * 2 * n_hi, w), dt)
    g_lo, g_hi, v = np.empty((n_lo, w), dt), np.empty((n_hi, w), dt), np.empty((3, w), dt)
    g0 = 0
    while g0 < g_count:
        if g_count - g0 >= _PAD_FROM:
            _backward_tile(
                k, gam, state, g_out, has_out, g_ent, g_scale, grad, g0, _TILE, True,
                p, q, g_p, ge, g_a, gto, lev_lo, lev_hi, g_lo, g_hi, v,
            )  # fmt: skip
            g0 += _TILE
        else:
            _backward_tile(
                k, gam, state, g_out, has_out, g_ent, g_scale, grad, g0, g_count - g0, False,
                p, q, g_p, ge, g_a, gto, lev_lo, lev_hi, g_lo, g_hi, v,
            )  # fmt: skip
            g0 = g_count
