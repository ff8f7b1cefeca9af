"""DSelect-k's small kernel on the host: NumPy arithmetic on zero-copy views of CPU tensors.

At a few examples the cost of the small DSelect-k kernel
(:class:`dselectk.kernels.aten._DSelectSmall`) is its calls, not its arithmetic: an ATen call
costs 2-6 µs of dispatch (more with a Python number argument), a NumPy ufunc on a few hundred
numbers about 1 µs. So for CPU float32 and float64 tensors (eager, outside torch.func
transforms and graph capture; :mod:`dselectk.kernels.dispatch` decides) the small kernel and
the one-node gate (:class:`dselectk.kernels.aten._DSelectSmallGate`) compute here. This module
holds arithmetic only (NumPy and torch, no autograd node, no choice of kernel).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch

__all__: list[str] = []

# The selector law is a product of two halves: the K selectors' laws over the high
# M_hi = M - M_lo bits (H = 2**M_hi codes) and over the low M_lo = floor(M/2) bits times σ(α)
# (L = 2**M_lo entries), each gathered from one table of factors and multiplied along F factors
# (prefix products), so the combine is one batched (H, K) @ (K, L) product per gate and its
# backward two. The backward of the halves' products takes the product of the other F - 1
# factors (prefix times suffix products: exact at zero factors, no division) and sums the
# factors' grads back onto the table rows with one product against a constant 0/1 matrix. The
# table holds, per selector, 1 - S(z_j) and S(z_j) of every bit j (rows j and M + j), σ(α) (row
# 2M) and, when M is even, a row of ones (the high half's pad): σ(α) is a factor of the low
# half, so its gradient comes out of the same product as the bits'. Same numbers as the ATen
# small kernel to float rounding (the products are associated differently), tested.

_HOST_TABLES: dict[tuple[int, str], tuple[Any, ...]] = {}


class _HostSaved:
    """What the host small kernel keeps for its backward (a non-tensor output of the node)."""

    __slots__ = ("arrays", "gam")

    def __init__(self, arrays: tuple[Any, ...], gam: Any) -> None:
        self.arrays = arrays
        self.gam = gam


def _host_tables(m: int, dtype: Any) -> tuple[Any, ...]:
    """Constant tables of the host kernel for M bits (cached per M and NumPy dtype).

    Returns:
        ``idx`` (F, H + L): the table row of factor f of each of the H high-half codes, then of
        the L low-half codes; ``onehot`` (rows, F·(H + L)): a 1 where factor (f, c) reads row
        ``idx[f, c]``; ``rows``, H, L and the dtype's smallest normal number.
    """
    key = (m, dtype.char)  # (hashing a NumPy dtype is slow)
    tables = _HOST_TABLES.get(key)
    if tables is None:
        m_lo = m // 2
        m_hi = m - m_lo
        f = max(m_hi, m_lo + 1)
        rows = 2 * m + 1 + (1 if m_hi < f else 0)
        h, lo = 2**m_hi, 2**m_lo
        idx = np.full((f, h + lo), 2 * m + 1, dtype=np.intp)  # padded with the ones row
        bits_hi = (np.arange(h) >> np.arange(m_hi)[:, None]) & 1  # (M_hi, H)
        bits_lo = (np.arange(lo) >> np.arange(m_lo)[:, None]) & 1
        idx[:m_hi, :h] = m_lo + np.arange(m_hi)[:, None] + m * bits_hi
        idx[:m_lo, h:] = np.arange(m_lo)[:, None] + m * bits_lo
        idx[m_lo, h:] = 2 * m  # σ(α)
        onehot = np.zeros((rows, f * (h + lo)), dtype=dtype)
        onehot[idx.reshape(-1), np.arange(f * (h + lo))] = 1
        tables = (idx, onehot, rows, h, lo, np.finfo(dtype).tiny)
        _HOST_TABLES[key] = tables
    return tables


def _host_gamma(gamma: torch.Tensor, dtype: torch.dtype) -> Any:
    """γ for the host kernel: a Python float (one γ; NumPy rounds it to the arrays' dtype, as
    ``gamma.to(z)`` does) or a (G, 1) array of the z dtype (one per gate)."""
    if gamma.dim() == 0:
        return float(gamma)
    return gamma.detach().to(dtype).numpy().reshape(-1, 1)


def _host_forward(z: Any, alpha: Any, gam: Any) -> tuple[Any, Any, tuple[Any, ...]]:
    """q̃ (G, N), entropies (G, K) and the saved arrays, from z (G, K, M), α (G, K) arrays."""
    g, k, m = z.shape
    gk = g * k
    idx, _, rows, h, _, tiny = _host_tables(m, z.dtype)
    tb = np.empty((rows, g, k), dtype=z.dtype)  # the factor table, selectors innermost
    s = np.divide(z.transpose(2, 0, 1), gam, order="C")  # (M, G, K)
    np.maximum(s, -0.5, out=s)
    np.minimum(s, 0.5, out=s)
    p = tb[m : 2 * m]
    np.multiply(s, s, out=p)  # s (1.5 - 2 s²) + 0.5, op for op
    p *= -2.0
    p += 1.5
    p *= s
    p += 0.5
    np.subtract(1.0, p, out=tb[:m])
    e = alpha - np.maximum.reduce(alpha, axis=1, keepdims=True)
    np.exp(e, out=e)
    np.divide(e, np.add.reduce(e, axis=1, keepdims=True), out=tb[2 * m])  # σ(α)
    if rows > 2 * m + 1:
        tb[2 * m + 1] = 1.0
    pq = tb[: 2 * m]
    log_pq = np.maximum(pq, tiny)  # log(1 - p), log p of every bit, clamped as the formulas do
    np.log(log_pq, out=log_pq)
    ent = np.add.reduce(pq * log_pq, axis=0)
    np.negative(ent, out=ent)
    fct = np.take(tb.reshape(rows, gk), idx, axis=0)  # (F, H + L, G·K): the factors
    pre = _cumprod(fct)  # products of the first 1, 2, ..., F factors
    r = pre[-1]  # (H + L, G·K): the high half's laws, then the low half's times σ(α)
    r_hi = r[:h].reshape(h, g, k).transpose(1, 0, 2)  # (G, H, K)
    r_lo = r[h:].reshape(-1, g, k).transpose(1, 2, 0)  # (G, K, L)
    out = np.matmul(r_hi, r_lo).reshape(g, -1)  # code = high · L + low
    return out, ent, (s, tb, log_pq, fct, pre)


#: up to this many multiply-adds, the host kernel's backward sums the factors' grads onto the
#: table rows with one product against its 0/1 matrix; above, one sum per bit (OpenBLAS runs a
#: product above 4 · 65536 multiply-adds on several threads, which stall beside busy processes)
_HOST_MATMUL_MAX_MACS = 2**18


def _table_grads(g_f: Any, m: int, h: int, onehot: Any) -> Any:
    """Sum the factors' grads ``g_f`` (F, H + L, G·K) onto the rows of the factor table."""
    gk = g_f.shape[-1]
    if onehot.size * gk <= _HOST_MATMUL_MAX_MACS:
        return np.matmul(onehot, g_f.reshape(-1, gk))
    m_lo = m // 2
    g_tb = np.empty((onehot.shape[0], gk), dtype=g_f.dtype)  # a padding ones row is not read
    g_bits = g_tb[: 2 * m].reshape(2, m, gk)  # (value, bit)
    for j in range(m - m_lo):  # high bit m_lo + j: its value splits the H codes in two halves
        g_bit = g_f[j, :h].reshape(-1, 2, 2**j, gk)
        np.add.reduce(g_bit, axis=(0, 2), out=g_bits[:, m_lo + j])
    for j in range(m_lo):
        g_bit = g_f[j, h:].reshape(-1, 2, 2**j, gk)
        np.add.reduce(g_bit, axis=(0, 2), out=g_bits[:, j])
    np.add.reduce(g_f[m_lo, h:], axis=0, out=g_tb[2 * m])  # σ(α)
    return g_tb


def _cumprod(fct: Any) -> Any:
    """Cumulative products along the first axis, one multiply per slice (``multiply.accumulate``
    along a first axis goes number by number: 100x slower)."""
    out = np.empty_like(fct)
    out[0] = fct[0]
    for j in range(1, fct.shape[0]):
        np.multiply(out[j - 1], fct[j], out=out[j])
    return out


def _others(fct: Any, pre: Any) -> Any:
    """The product of the other F - 1 factors of each factor (exact at zeros: no division),
    from the factors (F, ...) and their prefix products."""
    f = fct.shape[0]
    out = np.empty_like(fct)
    if f == 1:
        out.fill(1.0)
        return out
    suf = _cumprod(fct[::-1])  # suf[i]: the product of the last i + 1
    out[0] = suf[-2]
    out[-1] = pre[-2]
    if f > 2:
        np.multiply(pre[: f - 2], suf[f - 3 :: -1], out=out[1:-1])
    return out


def _host_backward(
    arrays: tuple[Any, ...], gam: Any, g_out: Any | None, g_ent: Any | None
) -> tuple[Any, Any | None]:
    """Grads of z, laid out (M, G, K), and of α (G, K) (None without ``g_out``).

    ``g_out`` (G, N), ``g_ent`` broadcastable to (G, K) (e.g. (G, 1) or a 0-d array), or None.
    """
    s, tb, log_pq, fct, pre = arrays
    m, g, k = s.shape
    gk = g * k
    _, onehot, _, h, lo, _ = _host_tables(m, s.dtype)
    r = pre[-1]
    g_alpha = None
    dent = log_pq.reshape(2, m, g, k)  # d h(p) / dp = log(1 - p) - log p (clamped logs)
    if g_out is not None:
        g3 = g_out.reshape(g, h, lo)
        g_hi = np.matmul(g3, r[h:].reshape(lo, g, k).transpose(1, 0, 2))  # (G, H, K)
        g_lo = np.matmul(g3.transpose(0, 2, 1), r[:h].reshape(h, g, k).transpose(1, 0, 2))
        g_r = np.concatenate((g_hi.transpose(1, 0, 2), g_lo.transpose(1, 0, 2)))  # (H + L, G, K)
        g_f = _others(fct, pre)
        g_f *= g_r.reshape(h + lo, gk)
        g_tb = _table_grads(g_f, m, h, onehot)  # (rows, G·K)
        g_p = np.subtract(g_tb[m : 2 * m], g_tb[:m]).reshape(m, g, k)
        g_a = g_tb[2 * m].reshape(g, k)
        a = tb[2 * m]
        g_alpha = a * (g_a - np.add.reduce(g_a * a, axis=1, keepdims=True))  # softmax backward
        if g_ent is not None:
            g_p += g_ent * (dent[0] - dent[1])
    else:
        assert g_ent is not None
        g_p = g_ent * (dent[0] - dent[1])
    # dS/dz = (1.5 - 6 s²) / γ, exactly 0 at |s| = 1/2 (so the clamp needs no mask).
    d = s * s
    d *= -6.0
    d += 1.5
    d *= g_p
    d /= gam
    return d, g_alpha


def _host_small(z: torch.Tensor, alpha: torch.Tensor, gamma: torch.Tensor) -> tuple[Any, ...]:
    """``_DSelectSmall``'s forward on the host: q̃ (G, N), entropies (G, K), saved state."""
    gam = _host_gamma(gamma, z.dtype)
    out, ent, arrays = _host_forward(z.detach().numpy(), alpha.detach().numpy(), gam)
    return torch.from_numpy(out), torch.from_numpy(ent), _HostSaved(arrays, gam)


def _host_small_grads(
    saved: _HostSaved, g_out: torch.Tensor | None, g_ent: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_DSelectSmall``'s backward on the host: grads of z (G, K, M) and α (G, K) (or None)."""
    d, g_alpha = _host_backward(
        saved.arrays,
        saved.gam,
        None if g_out is None else g_out.detach().numpy(),
        None if g_ent is None else g_ent.detach().numpy(),
    )
    g_z = torch.from_numpy(np.ascontiguousarray(d.transpose(1, 2, 0)))
    return g_z, None if g_alpha is None else torch.from_numpy(g_alpha)


def _host_gate(
    logits: torch.Tensor, gamma: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, _HostSaved]:
    """The host kernel on a gate's logits (G, K(1+M)): q̃ (G, N), entropies (G, K), state."""
    g, c = logits.shape
    x = logits.detach().numpy()
    gam = _host_gamma(gamma, logits.dtype)
    out, ent, arrays = _host_forward(x[:, k:].reshape(g, k, c // k - 1), x[:, :k], gam)
    return torch.from_numpy(out), torch.from_numpy(ent), _HostSaved(arrays, gam)


def _host_entropy_grad(
    g_aux: torch.Tensor, lam: torch.Tensor, divisor: int, dtype: torch.dtype
) -> Any:
    """The grad of each selector's entropy from the grad of λ Σ h / divisor, for one λ (0-d):
    the loss nodes' backward (``/ divisor``, ``* λ``, the cast to the entropies' dtype) done on
    0-d arrays, the same IEEE operations in the same dtypes, so the same number."""
    ga = g_aux.detach().numpy()  # the loss's dtype: λ's and the entropies' promotion
    if divisor != 1:
        ga = ga / np.asarray(divisor, dtype=ga.dtype)
    v = ga * lam.detach().numpy().astype(ga.dtype)
    return np.asarray(v, dtype=np.float32 if dtype == torch.float32 else np.float64)


def _entropy_loss(
    ent: torch.Tensor, lam: torch.Tensor, k: int, lead: tuple[int, ...], per_example: bool
) -> torch.Tensor:
    """λ Σ_i h_i per gate, summed over the gates (per example: / batch), as the gate writes it."""
    per_gate = lam * ent.view(*lead, k).sum(dim=-1)
    return per_gate.sum() / lead[0] if per_example else per_gate.sum()


def _entropy_grad(ctx: Any, g_aux: torch.Tensor, lam: torch.Tensor) -> Any:
    """The grad of each selector's entropy (an array broadcastable to (G, K)) from the grad of
    :func:`_entropy_loss`: its nodes' backward, op for op (/ batch, expand, * λ, cast)."""
    lead = ctx.lead
    divisor = lead[0] if ctx.per_example else 1
    if lam.dim() == 0:
        return _host_entropy_grad(g_aux, lam, divisor, ctx.dtype)
    g_gate = g_aux / divisor if ctx.per_example else g_aux
    g_gate = (g_gate.expand(lead) * lam).to(ctx.dtype)
    return g_gate.reshape(math.prod(lead), 1).numpy()


def _host_gate_grad(
    saved: _HostSaved, g_w: torch.Tensor | None, g_ent: Any | None, k: int
) -> torch.Tensor:
    """The grad of the gate's logits (G, K(1+M)) from the grads of q̃ and of the entropies."""
    d, g_alpha = _host_backward(
        saved.arrays,
        saved.gam,
        None if g_w is None else g_w.detach().reshape(saved.arrays[0].shape[1], -1).numpy(),
        g_ent,
    )
    m, g, _ = d.shape
    grad = np.empty((g, k * (1 + m)), dtype=d.dtype)
    grad[:, :k] = 0.0 if g_alpha is None else g_alpha
    grad[:, k:].reshape(g, k, m)[...] = d.transpose(1, 2, 0)
    return torch.from_numpy(grad)


class _Transformed:
    """``with _Transformed():`` around a kernel node's ``apply`` under a torch.func transform
    (``dselectk.kernels.aten._apply``): under ``torch.func.grad`` the node's forward runs with the
    transform lifted, and the host kernels (whose backward cannot read grad-tracking tensors)
    must stay off there; :meth:`depth` says how many such calls this thread is inside."""

    _local = threading.local()

    @classmethod
    def depth(cls) -> int:
        return int(getattr(cls._local, "depth", 0))

    def __enter__(self) -> None:
        self._local.depth = self.depth() + 1

    def __exit__(self, *exc: object) -> None:
        self._local.depth -= 1
