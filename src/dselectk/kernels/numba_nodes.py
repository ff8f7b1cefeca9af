"""The autograd nodes of the DSelect-k gate on the numba kernel, their glue, and the warm-up.

:class:`_NumbaGate` (logits in) and :class:`_NumbaGateLinear` (the gate's linear layer inside)
run a gate's whole step on :mod:`dselectk.kernels.numba_cpu` (the ``fast`` extra; which kernel a
gate takes is :func:`dselectk.kernels.dispatch.choose`'s): weights and the entropy loss out, one
node, any size, the numbers of the gate as written to float rounding (tested). Eager only: the
gate calls them for CPU float32/float64 tensors outside torch.func transforms and graph capture.
:func:`warm_kernels` compiles the kernel (or loads it from numba's cache) ahead of time.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dselectk.kernels.aten import _linear, _linear_grads, _PositionalFunction
from dselectk.kernels.setting import _cache_failed, _cache_warning, _cpu_kernel, _load_numba
from dselectk.runtime import _OneThread

__all__ = ["warm_kernels"]


class _NumbaSaved:
    """What the numba kernel keeps for its backward (a non-tensor output of the node): the
    logits (G, K(1+M)), γ, K, and per gate σ(α), the clamped z/γ and log(1 - p) - log p of each
    bit (``dselectk.kernels.numba_cpu.state_shape``: (K(1 + 2M), G))."""

    __slots__ = ("gam", "k", "logits", "state")

    def __init__(self, logits: Any, gam: Any, k: int, state: Any) -> None:
        self.logits = logits
        self.gam = gam
        self.k = k
        self.state = state


_TINY = {"f": float(np.finfo(np.float32).tiny), "d": float(np.finfo(np.float64).tiny)}


def _numba_values(t: torch.Tensor, dtype: Any) -> Any:
    """γ or λ as the numba kernel reads them: a contiguous 1-D array of ``dtype``, (1,) for one
    value or (T,) with one per gate (gate g reads entry g mod T, the gates' last axis)."""
    if t.dim() == 0:
        return np.array((t.item(),), dtype=dtype)  # (exact: a float64 holds any float32)
    return np.ascontiguousarray(t.detach().cpu().numpy().reshape(-1), dtype=dtype)


def _numba_forward(
    logits: torch.Tensor, gamma: torch.Tensor, lam: Any, k: int, divisor: float
) -> tuple[torch.Tensor, float, _NumbaSaved]:
    """The numba kernel on logits (G, K(1+M)): q̃ (G, N), the loss Σ_g λ_g Σ_i h_gi / divisor
    (a float; λ from :func:`_numba_values`) and what the backward needs."""
    g, c = logits.shape
    m = c // k - 1
    x = (logits.detach() if logits.requires_grad else logits).numpy()
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    dt = x.dtype
    gam = _numba_values(gamma, dt)  # rounded to the logits' dtype, as ATen's gamma.to(z)
    # (a torch tensor viewed in NumPy, not torch.from_numpy: an autograd node returning a
    # tensor made from a NumPy array costs ~7 µs more per call, measured)
    out = torch.empty((g, 1 << m), dtype=logits.dtype)
    nb = _load_numba(None)
    state = np.empty(nb.state_shape(g, k, m), dtype=dt)
    args = (x, k, gam, lam, divisor, _TINY[dt.char], out.numpy(), state)
    if ("forward", dt.char) in _READY:
        loss = nb.gate_forward(*args)
    else:
        loss = _first_call("forward", dt.char, args)
    return out, loss, _NumbaSaved(x, gam, k, state)


#: (kernel, dtype char) called at least once in this process (compiled or loaded from the cache)
_READY: set[tuple[str, str]] = set()


def _first_call(kind: str, dt: str, args: tuple[Any, ...], warn: bool = True) -> Any:
    """The first call of a kernel for a dtype in this process; a RuntimeWarning when it had to
    compile (nothing cached: about 15 s, see :mod:`dselectk.kernels.setting`), so that a slow
    first step, in each of a sweep's fresh worker processes, is not silent. Where numba cannot
    write the compiled code to its cache (an ``OSError``: numba adds the compiled code to the
    function before it saves it), the call runs again on the code compiled in memory, with one
    warning per process (:func:`~dselectk.kernels.setting._cache_warning`)."""
    nb = _load_numba(None)
    kernel = getattr(nb, f"gate_{kind}")
    start = time.perf_counter()
    try:
        result = kernel(*args)
    except OSError as err:  # the kernel does no I/O: numba's cache could not be written
        _cache_warning(f"writing it failed: {err}")
        result = kernel(*args)
    took = time.perf_counter() - start
    _READY.add((kind, dt))
    if took > 1.0 and warn and nb.CACHE and not _cache_failed[0]:
        warnings.warn(
            f"dselectk: compiling the numba DSelect-k kernel ({kind}, {np.dtype(dt).name}) took "
            f"{took:.0f} s; numba caches it on disk for later processes (NUMBA_CACHE_DIR), and "
            "dselectk.kernels.warm_kernels() compiles it before starting worker processes",
            RuntimeWarning,
            stacklevel=2,
        )
    return result


def _numba_grad(
    saved: _NumbaSaved, g_out: torch.Tensor | None, g_ent: Any, g_scale: float
) -> torch.Tensor:
    """The grad of the logits (G, K(1+M)) from the grad of q̃ (G, N) and of the entropies,
    ``g_scale`` · ``g_ent`` (a contiguous float64 array broadcast to (G, K) by gate g mod rows
    and selector i mod columns: (1, 1), (T, 1) or (G, K))."""
    x = saved.logits
    grad = np.empty_like(x)  # (here from_numpy is the cheaper way: ~9 µs less, measured)
    if g_out is None:
        go, has_out = grad, False
    else:
        go = (g_out.detach() if g_out.requires_grad else g_out).numpy()
        if not go.flags.c_contiguous:  # e.g. the expanded grad of a sum
            go = np.ascontiguousarray(go)
        has_out = True
    args = (saved.k, saved.gam, saved.state, go, has_out, g_ent, g_scale, grad)
    if ("backward", x.dtype.char) in _READY:
        _load_numba(None).gate_backward(*args)
    else:
        _first_call("backward", x.dtype.char, args)
    return torch.from_numpy(grad)


def _loss_dtype(lam: torch.Tensor, dtype: torch.dtype, lead: tuple[int, ...]) -> torch.dtype:
    """The dtype of :func:`_entropy_loss`: λ times the entropies' sums (*lead,), promoted as
    torch promotes (a 0-d λ does not promote a tensor of gates, a 0-d sum (lead ()) does)."""
    if lam.dtype == dtype or (lam.dim() == 0 and lead):
        return dtype
    return torch.promote_types(lam.dtype, dtype)


def _numba_gate(
    logits: torch.Tensor,
    gamma: torch.Tensor,
    lam: torch.Tensor,
    k: int,
    lead: tuple[int, ...],
    per_example: bool,
) -> tuple[torch.Tensor, torch.Tensor, _NumbaSaved]:
    """:func:`_entropy_loss` and q̃ (*lead, N) of a gate on the numba kernel, from its logits
    (G, K(1+M)): the loss λ Σ_i h_i per gate, summed over the gates in float64 (per example:
    / batch), then rounded to the loss's dtype."""
    divisor = float(lead[0]) if per_example else 1.0
    lam_np = _numba_values(lam, np.float64)
    out, loss, saved = _numba_forward(logits, gamma, lam_np, k, divisor)
    aux = torch.scalar_tensor(loss, dtype=_loss_dtype(lam, logits.dtype, lead))
    return (out if len(lead) == 1 else out.view(*lead, -1)), aux, saved


_ONES = np.ones((1, 1))
_ONE_LAMBDA = np.ones(1)


def _numba_gate_grad(
    saved: _NumbaSaved,
    g_w: torch.Tensor | None,
    g_aux: torch.Tensor | None,
    lam: torch.Tensor,
    lead: tuple[int, ...],
    per_example: bool,
) -> torch.Tensor:
    """The grad of a gate's logits (G, K(1+M)) from the grads of q̃ and of :func:`_numba_gate`'s
    loss: each selector's entropy gets (g_aux / batch) λ of its gate, in float64."""
    g_out = g_w if g_w is None or g_w.dim() == 2 else g_w.reshape(saved.logits.shape[0], -1)
    if g_aux is None:
        return _numba_grad(saved, g_out, _ONES, 0.0)
    scale = g_aux.item() / (lead[0] if per_example else 1)
    if lam.dim() == 0:
        return _numba_grad(saved, g_out, _ONES, scale * lam.item())
    return _numba_grad(saved, g_out, _numba_values(lam, np.float64).reshape(-1, 1), scale)


def _once_differentiable(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.autograd.function.once_differentiable`` without its ``no_grad`` block where grad
    mode is off already (a plain backward: the block costs ~2 µs a call, measured, and changes
    nothing there); with ``create_graph`` it is once_differentiable itself (a double backward
    through the node raises)."""
    once = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def run(ctx: Any, *grads: Any) -> Any:
        return once(ctx, *grads) if torch.is_grad_enabled() else backward(ctx, *grads)

    return run


class _NumbaGate(_PositionalFunction):
    """:class:`_DSelectSmallGate` on the numba kernel (any size): (logits (G, K(1+M)), γ (0-d or
    (T,): gate g reads γ[g mod T]), λ (likewise), K, lead, per_example) -> (q̃ (*lead, N),
    auxiliary loss ()). The loss is summed over the gates in float64 in the kernel
    (:func:`_numba_gate`): the gate's numbers to float rounding.

    Eager only (the gate checks, see :func:`_host_ok`), so ``forward`` takes ``ctx`` itself
    (no ``setup_context``, which torch.func needs and which costs ~10 µs a call, measured) and
    keeps the kernel's state there."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        gamma: Tensor,
        lam: Tensor,
        k: int,
        lead: tuple[int, ...],
        per_example: bool,
    ) -> tuple[Tensor, Tensor]:
        w, aux, ctx.host = _numba_gate(logits, gamma, lam, k, lead, per_example)
        ctx.set_materialize_grads(False)
        ctx.lead, ctx.per_example = lead, per_example
        ctx.save_for_backward(lam)  # (an in-place change of λ before backward raises)
        return w, aux

    @staticmethod
    @_once_differentiable
    def backward(ctx: Any, g_w: Tensor | None, g_aux: Tensor | None) -> tuple[Any, ...]:
        none = (None,) * 5
        if g_w is None and g_aux is None:
            return (None, *none)
        (lam,) = ctx.saved_tensors
        return (_numba_gate_grad(ctx.host, g_w, g_aux, lam, ctx.lead, ctx.per_example), *none)


class _NumbaGateLinear(_PositionalFunction):
    """:class:`_DSelectSmallGateLinear` on the numba kernel (any size): (x (B, p), weight, bias
    or None, γ, λ, K, lead, per_example) -> (q̃ (*lead, N), auxiliary loss ()), the layer's ATen
    calls forward and backward on one intra-op thread (the kernel runs on the calling thread).
    Eager only, ``forward`` with ``ctx`` as :class:`_NumbaGate`."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        gamma: Tensor,
        lam: Tensor,
        k: int,
        lead: tuple[int, ...],
        per_example: bool,
    ) -> tuple[Tensor, Tensor]:
        with _OneThread():
            logits = _linear(x, weight, bias)
        if len(lead) > 1:  # a bank: (B, T·K(1+M)) -> (B·T, K(1+M))
            logits = logits.view(math.prod(lead), -1)
        w, aux, ctx.host = _numba_gate(logits, gamma, lam, k, lead, per_example)
        ctx.set_materialize_grads(False)
        ctx.lead, ctx.per_example = lead, per_example
        ctx.save_for_backward(lam, x, weight)
        return w, aux

    @staticmethod
    @_once_differentiable
    def backward(ctx: Any, g_w: Tensor | None, g_aux: Tensor | None) -> tuple[Any, ...]:
        none = (None,) * 5
        if g_w is None and g_aux is None:
            return (None, None, None, *none)
        lam, x, weight = ctx.saved_tensors
        g = _numba_gate_grad(ctx.host, g_w, g_aux, lam, ctx.lead, ctx.per_example)
        if len(ctx.lead) > 1:
            g = g.view(x.shape[0], -1)
        with _OneThread():
            return (*_linear_grads(g, x, weight, ctx.needs_input_grad), *none)


def warm_kernels(dtypes: tuple[Any, ...] = (np.float32, np.float64)) -> float:
    """Compile (or load from numba's on-disk cache) the numba kernel for ``dtypes`` (NumPy
    float32 and/or float64), so that worker processes started afterwards load it instead of
    compiling it each.

    Returns:
        The seconds it took (see :mod:`dselectk.kernels.setting`); 0.0 without numba or where
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
        char = np.dtype(dt).char
        tiny = float(np.finfo(dt).tiny)
        _first_call("forward", char, (x, 1, gam, np.ones(1), 1.0, tiny, out, state), False)
        args = (1, gam, state, out, True, np.ones((1, 1)), 1.0, x.copy())
        _first_call("backward", char, args, False)
    return time.perf_counter() - start
