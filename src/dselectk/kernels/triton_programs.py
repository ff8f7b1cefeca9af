"""The Triton kernels of :mod:`dselectk.kernels.triton_cuda` (imported on first use only:
Triton decides at import whether to compile them or run them in its interpreter,
``TRITON_INTERPRET=1``)."""
# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bwd", "fwd"]


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _bits(z_ptr, gam, tiny, row, M: tl.constexpr, MP: tl.constexpr):
    """s, p = S(z/γ), 1 - p and the clamped logs of one selector's M bits (padded to MP)."""
    j = tl.arange(0, MP)
    z = tl.load(z_ptr + row * M + j, mask=j < M, other=0.0)
    s = tl.minimum(tl.maximum(z / gam, -0.5), 0.5)
    p = s * s
    p = p * -2.0 + 1.5
    p = p * s + 0.5
    q = 1.0 - p
    lp = tl.log(tl.maximum(p, tiny))
    lq = tl.log(tl.maximum(q, tiny))
    return s, p, q, lp, lq


@triton.jit
def _factors(p, q, M: tl.constexpr, N: tl.constexpr, MP: tl.constexpr):
    """(N, MP): f[i, j] = p_j where bit j of i is set, else 1 - p_j; 1 in the padding."""
    i = tl.arange(0, N)[:, None]
    j = tl.arange(0, MP)[None, :]
    bit = (i >> j) & 1
    f = tl.where(bit == 1, p[None, :], q[None, :])
    return tl.where(j < M, f, 1.0), bit, j


@triton.jit
def fwd(
    z_ptr, a_ptr, gam_ptr, tiny_ptr, out_ptr, ent_ptr,
    GAM_STRIDE: tl.constexpr, K: tl.constexpr, M: tl.constexpr, N: tl.constexpr,
    MP: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    gam = tl.load(gam_ptr + g * GAM_STRIDE)
    tiny = tl.load(tiny_ptr)
    kk = tl.arange(0, KP)
    alpha = tl.load(a_ptr + g * K + kk, mask=kk < K, other=-float("inf"))
    e = tl.exp(alpha - tl.max(alpha, axis=0))
    a = e / tl.sum(e, axis=0)
    out = tl.zeros([N], dtype=a.dtype)
    for k in tl.static_range(K):
        _, p, q, lp, lq = _bits(z_ptr, gam, tiny, g * K + k, M, MP)
        j = tl.arange(0, MP)
        ent = -tl.sum(tl.where(j < M, q * lq + p * lp, 0.0), axis=0)
        tl.store(ent_ptr + g * K + k, ent)
        f, _, _ = _factors(p, q, M, N, MP)
        r = tl.reduce(f, 1, _mul)
        a_k = tl.sum(tl.where(kk == k, a, 0.0), axis=0)
        out += a_k * r
    tl.store(out_ptr + g * N + tl.arange(0, N), out)


@triton.jit
def bwd(
    z_ptr, a_ptr, gam_ptr, tiny_ptr, gout_ptr, gent_ptr,
    gz_ptr, ga_ptr, GAM_STRIDE: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
    N: tl.constexpr, MP: tl.constexpr, KP: tl.constexpr, HAS_GOUT: tl.constexpr,
    HAS_GENT: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    gam = tl.load(gam_ptr + g * GAM_STRIDE)
    tiny = tl.load(tiny_ptr)
    kk = tl.arange(0, KP)
    alpha = tl.load(a_ptr + g * K + kk, mask=kk < K, other=-float("inf"))
    e = tl.exp(alpha - tl.max(alpha, axis=0))
    a = e / tl.sum(e, axis=0)
    ii = tl.arange(0, N)
    g_a = tl.zeros([KP], dtype=a.dtype)
    for k in tl.static_range(K):
        s, p, q, lp, lq = _bits(z_ptr, gam, tiny, g * K + k, M, MP)
        j1 = tl.arange(0, MP)
        g_p = tl.zeros([MP], dtype=a.dtype)
        if HAS_GOUT:
            gout = tl.load(gout_ptr + g * N + ii)
            f, bit, j = _factors(p, q, M, N, MP)
            r = tl.reduce(f, 1, _mul)
            g_a = tl.where(kk == k, tl.sum(r * gout, axis=0), g_a)
            a_k = tl.sum(tl.where(kk == k, a, 0.0), axis=0)
            g_r = gout * a_k
            for jj in tl.static_range(M):
                rest = tl.reduce(tl.where(j == jj, 1.0, f), 1, _mul)  # Π over l != jj
                sign = tl.sum(tl.where(j == jj, bit * 2 - 1, 0), axis=1)  # ±1 per code
                g_pj = tl.sum(g_r * rest * sign.to(g_r.dtype), axis=0)
                g_p = tl.where(j1 == jj, g_pj, g_p)
        if HAS_GENT:
            g_e = tl.load(gent_ptr + g * K + k)
            g_p += g_e * (lq - lp)
        g_s = (s * s * -6.0 + 1.5) * g_p / gam
        tl.store(gz_ptr + (g * K + k) * M + j1, g_s, mask=j1 < M)
    if HAS_GOUT:
        g_alpha = a * (g_a - tl.sum(g_a * a, axis=0))
        tl.store(ga_ptr + g * K + kk, g_alpha, mask=kk < K)
