"""Process-level settings for fast CPU training.

PyTorch's CPU allocator takes every tensor from the C library's ``malloc``. glibc serves
blocks above a threshold (128 KiB at first, adapting up to 32 MiB) with ``mmap`` and returns
them to the operating system on ``free``, so a training loop that allocates the same large
activations every step page-faults (and has the kernel zero) each of them again every step.
For the small, allocation-heavy models of this package that is 20-30 % of a step (measured:
the per-example gate benchmark 11.2 -> 7.8 ms fwd+bwd). PyTorch's CPU tuning guide recommends
swapping the allocator (jemalloc, tcmalloc) for the same reason; :func:`tune_allocator` gets most
of the gain with glibc's own ``mallopt``, without a dependency.

This module also holds the host arithmetic of the DSelect-k kernels (private helpers, see the
comment at ``_host_forward``): how a few examples run fastest on the CPU in NumPy, and the glue
of the compiled kernel (:mod:`dselectk._numba`) that takes CPU problems of every size.

Which CPU kernel a :class:`~dselectk.gates.DSelectK` gate uses (CPU float32/float64 tensors,
eager: no torch.func transform, graph capture or compilation, γ without a gradient; the
gate's own math without ``distinct`` codes or the unused-code penalty) is read from the
environment variable ``DSELECTK_KERNEL`` at each call:

* unset, empty or ``auto``: ``numba`` when numba is installed (``pip install dselectk[fast]``),
  else ``numpy``;
* ``numba``: the compiled kernel at every size, on the calling thread (one thread; the gate's
  linear layer runs on one intra-op thread too). Raises ``ImportError`` naming the ``fast``
  extra when numba is missing;
* ``numpy``: the NumPy host kernel up to
  :data:`~dselectk.functional.HOST_GATE_MAX_ELEMENTS` selector entries, the ATen kernels above
  (what the package does without numba);
* ``aten``: the ATen kernels at every size (no host kernel).

Any other value raises ``ValueError`` naming the variable. The numba kernel compiles on its
first call in a process, once per dtype, and caches the machine code on disk (numba's
``cache=True``): in ``$NUMBA_CACHE_DIR`` when set (a writable folder for read-only installs
and containers), else next to ``dselectk/_numba.py`` when that folder is writable, else in
numba's per-user cache folder (``~/.cache/numba`` on Linux). Measured on a 2-core
EPYC at load 1.5: with nothing cached the first float32 call compiles for 31 s (forward 13.7 s,
backward 16.9 s; float64 28 s more), and warns (RuntimeWarning) that it did; with the cache
the first call takes 0.5 s, plus 0.3 s to import numba. Each fresh process compiles unless the
cache is warm when it starts (numba writes its files atomically: concurrent workers are safe,
only slow): call :func:`warm_kernels` once before starting worker processes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import importlib.util
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

__all__ = [
    "KERNEL_ENV",
    "PARALLEL_MIN_ELEMENTS",
    "exit_with_parent",
    "intra_op_threads",
    "tune_allocator",
    "warm_kernels",
]

#: problems with fewer elements than this run their ops on one thread inside the package's
#: kernels (:func:`intra_op_threads` with ``elements``). Below it an OpenMP parallel region
#: buys little (a 2-core CPU: DSelect-k at B = 4096 is 10.4 ms on 2 threads vs 11.8 ms on 1)
#: and every region ends in a barrier that waits for the slowest thread: beside busy processes
#: that thread is often descheduled, and a step of tiny ops then takes 10-40x its idle time
#: (measured: the per-example gate at B = 1, 2 threads, load 7.7: 28 ms vs 2.1 ms on 1 thread).
PARALLEL_MIN_ELEMENTS = 2**22


# What to set on a shared or busy machine (measured with ``python -m benchmarks --only
# small_batch``, 2-core EPYC, 3 busy processes): the package's DSelect-k kernels already run
# small problems on one thread, but the ops around them (the gate's nn.Linear and its backward,
# the rest of a model) still open 2-thread parallel regions, and a per-example gate step at
# B = 16 took 141 ms there against 2.6 ms with the whole step inside ``intra_op_threads(1)``
# (Top-k: 244 ms). So for small batches beside other processes, train on one thread
# (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``, or this context manager around the step);
# give a process several threads only when its ops are large and the cores are its own.


@contextmanager
def intra_op_threads(threads: int = 1, *, elements: int | None = None) -> Iterator[int]:
    """Run the enclosed torch ops on at most ``threads`` intra-op threads, then restore.

    With ``elements``, the limit applies only below :data:`PARALLEL_MIN_ELEMENTS` (larger
    problems keep the current thread count). The switch costs a few microseconds
    (``torch.set_num_threads``); it is skipped when nothing changes. It holds for the calling
    thread, which on the CPU is also the thread that runs the backward pass of its graph.

    Yields:
        The number of threads in effect inside the block.
    """
    before = torch.get_num_threads()
    limit = threads if elements is None or elements < PARALLEL_MIN_ELEMENTS else before
    if limit >= before:
        yield before
        return
    torch.set_num_threads(max(1, limit))
    try:
        yield max(1, limit)
    finally:
        torch.set_num_threads(before)


class _OneThread:
    """``with _OneThread():`` runs the enclosed torch ops on one intra-op thread, then restores
    the count: :func:`intra_op_threads` (1) for the hot paths of the small kernels (a class costs
    ~0.5 µs a use, the generator-based context manager ~4 µs). Beside busy processes a 2-thread
    MKL product of a small gate's linear layer took 30-50 ms instead of 30-60 µs (its OpenMP
    barrier waits for a descheduled thread); on one thread it is also faster when idle."""

    __slots__ = ("before",)

    def __enter__(self) -> None:
        self.before = before = torch.get_num_threads()
        if before > 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.before > 1:
            torch.set_num_threads(self.before)


# -- host arithmetic of the small DSelect-k kernel ---------------------------------------------
#
# At a few examples the cost of the small DSelect-k kernel (dselectk._kernels._DSelectSmall) is
# its calls, not its arithmetic: an ATen call costs 2-6 µs of dispatch (more with a Python
# number argument), a NumPy ufunc on a few hundred numbers about 1 µs. So for CPU float32 and
# float64 tensors (eager, outside torch.func transforms and graph capture; the kernels decide)
# the small kernel computes here, in NumPy, on zero-copy views of the tensors.
#
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
    (``dselectk._kernels._apply``): under ``torch.func.grad`` the node's forward runs with the
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


# -- the compiled kernel (numba) and the choice of kernel ---------------------------------------

#: the environment variable that picks the DSelect-k gate's CPU kernel (see the module docstring)
KERNEL_ENV = "DSELECTK_KERNEL"
_KERNEL_VALUES = ("auto", "numba", "numpy", "aten")
_kernel_seen: list[Any] = [object(), "numpy"]  # (the variable's raw value, its kernel)
_numba_module: Any = None


#: the variable's key in CPython's ``os.environ._data`` (bytes on POSIX), None elsewhere
_KERNEL_ENV_KEY: Any = getattr(os.environ, "encodekey", lambda key: None)(KERNEL_ENV)


def _kernel_env_raw() -> Any:
    """The variable's value as ``os.environ`` stores it (``os.environ.get`` encodes the key and
    decodes the value: ~1 µs of a small gate's step, measured), None when unset."""
    data = getattr(os.environ, "_data", None)
    if data is None or _KERNEL_ENV_KEY is None:
        return os.environ.get(KERNEL_ENV)
    return data.get(_KERNEL_ENV_KEY)


def _cpu_kernel() -> str:
    """``"numba"``, ``"numpy"`` or ``"aten"``: the CPU kernel ``DSELECTK_KERNEL`` asks for (see
    the module docstring), resolved once per value of the variable."""
    raw = _kernel_env_raw()
    if raw is _kernel_seen[0] or raw == _kernel_seen[0]:
        return str(_kernel_seen[1])
    value = os.environ.get(KERNEL_ENV)
    choice = (value or "auto").strip().lower()
    if choice not in _KERNEL_VALUES:
        raise ValueError(
            f"{KERNEL_ENV}={value!r} is not one of {', '.join(_KERNEL_VALUES)} (or unset: auto)"
        )
    if choice == "auto":
        choice = "numba" if importlib.util.find_spec("numba") is not None else "numpy"
    if choice == "numba":
        _load_numba(value)
    _kernel_seen[:] = [raw, choice]
    return choice


def _load_numba(value: str | None) -> Any:
    """Import :mod:`dselectk._numba` (and numba); an ``ImportError`` that says what to do when
    numba is missing or broken (never a silent fall back to another kernel)."""
    global _numba_module
    if _numba_module is None:
        try:  # (a leaf module: it imports numba and numpy only, so no import cycle)
            _numba = importlib.import_module(f"{__package__}._numba")
        except ImportError as err:
            how = (
                f"{KERNEL_ENV}={value} asks for the numba kernel"
                if value and value.strip().lower() == "numba"
                else "numba is installed, so the DSelect-k gate uses its kernel"
            )
            raise ImportError(
                f"{how}, but numba does not import ({err}); install the extra "
                f"(pip install 'dselectk[fast]') or set {KERNEL_ENV}=numpy"
            ) from err
        _numba_module = _numba
    return _numba_module


def warm_kernels(dtypes: tuple[Any, ...] = (np.float32, np.float64)) -> float:
    """Compile (or load from numba's on-disk cache) the numba kernel for ``dtypes`` (NumPy
    float32 and/or float64), so that worker processes started afterwards load it instead of
    compiling it each.

    Returns:
        The seconds it took (see the module docstring); 0.0 without numba or where
        ``DSELECTK_KERNEL`` picks another kernel.
    """
    if _cpu_kernel() != "numba":
        return 0.0
    nb = _load_numba(None)
    start = time.perf_counter()
    for dt in dtypes:
        x = np.zeros((1, 4), dtype=dt)  # one gate, K = 1, M = 3
        out, state = np.empty((1, 8), dtype=dt), np.empty(nb.state_shape(1, 1, 3), dtype=dt)
        gam = np.ones(1, dtype=dt)
        nb.gate_forward(x, 1, gam, np.ones(1), 1.0, float(np.finfo(dt).tiny), out, state)
        nb.gate_backward(1, gam, state, out, True, np.ones((1, 1)), 1.0, x.copy())
    return time.perf_counter() - start


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum on 64-bit systems
_TRIM_THRESHOLD = 2**31 - 1

_tuned: bool | None = None


def tune_allocator() -> bool:
    """Keep freed large blocks in the process heap instead of returning them to the OS.

    Sets glibc's ``M_MMAP_THRESHOLD`` to 32 MiB and ``M_TRIM_THRESHOLD`` to 2 GiB, so blocks
    up to 32 MiB are reused from the heap. The process keeps its peak heap size instead of
    shrinking after each step. Called by the ``dselectk`` command and the benchmarks; call it
    yourself at the start of a training script. Safe to call more than once.

    Returns:
        True if the settings were applied; False on systems without glibc (macOS, Windows,
        musl), where nothing changes.
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        _tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
            mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
        )
    return _tuned


_PR_SET_PDEATHSIG = 1


def exit_with_parent(parent_pid: int) -> bool:
    """Have the kernel send this process SIGTERM when its parent dies (Linux ``prctl``).

    For worker processes of a sweep: if the sweep's main process is killed (even with
    ``kill -9``), its workers stop too instead of training on as orphans. What they had
    finished is already saved (records are written atomically), so the same command resumes.
    Exits at once if the parent is already gone (``parent_pid`` is the parent's pid as the
    parent saw it, to close the race between start-up and this call).

    Returns:
        True if set; False where ``prctl`` is unavailable (not Linux), where nothing changes.
    """
    if os.getppid() != parent_pid:
        os._exit(1)
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return False
    ok = prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    return ok
