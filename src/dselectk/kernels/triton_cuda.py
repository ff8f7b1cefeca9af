"""DSelect-k's small-problem math in two Triton kernels, for CUDA tensors (optional).

On a GPU a per-example gate step costs its kernel launches, not its arithmetic: the ATen form
of the small kernel (:class:`dselectk.kernels.aten._DSelectSmall`) launches ~15 kernels forward
and ~20 backward (``python -m benchmarks.gpu_gate`` counts them). :class:`DSelectTriton` is the
same function, (z (G, K, M), α (G, K), γ (0-d or (G,))) -> (q̃ (G, N), entropies (G, K)), in one
kernel each way: one program per gate computes its K selectors' bit probabilities p = S(z/γ),
the N = 2**M code probabilities r_k(i) = Π_j f_kj(i) (f = p where bit j of i is set, else
1 - p), the σ(α) mixture and the bit entropies; the backward recomputes them (nothing but the
inputs is saved) and takes the product of the other M - 1 factors of each (i, j) by masking,
exact at zero factors (no division), as the ATen form does.

Same numbers as the ATen form to float rounding (tested in Triton's interpreter on the CPU,
``TRITON_INTERPRET=1``, and on a GPU). Used by :func:`dselectk.kernels.dselect_k_fused` for
CUDA float32/float64 tensors of at most ``dispatch.TRITON_MAX_BITS`` bits when Triton
imports, in eager mode (not under ``torch.compile``, tracing, export or ``torch.func``
transforms, which take the ATen form); ``DSELECTK_TRITON=0`` turns it off. The kernels are
built on first use, so the environment can be set before.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

__all__ = ["DSelectTriton", "available", "backward", "forward"]

_DTYPES = (torch.float32, torch.float64)
_TINY: dict[tuple[torch.dtype, torch.device], Tensor] = {}


@functools.cache
def _triton() -> Any:
    """The triton module, or None when it does not import (CPU-only installs)."""
    try:
        import triton
    except ImportError:
        return None
    return triton


def available(z: Tensor) -> bool:
    """Whether :class:`DSelectTriton` takes ``z``: a CUDA float32/float64 tensor, Triton
    importable, ``DSELECTK_TRITON`` not ``0``, eager (the caller checks graph capture)."""
    return (
        z.is_cuda
        and z.dtype in _DTYPES
        and os.environ.get("DSELECTK_TRITON", "1") != "0"
        and not torch._C._are_functorch_transforms_active()
        and _triton() is not None
    )


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The forward and backward kernels (their module is imported on first use)."""
    from dselectk.kernels import triton_programs as tk

    return tk.fwd, tk.bwd


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _launch_args(z: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor, dict[str, int]]:
    g, k, m = z.shape
    gam = gamma.to(z).reshape(-1).contiguous()
    key = (z.dtype, z.device)
    tiny = _TINY.get(key)
    if tiny is None:  # once per dtype and device: a copy to the GPU blocks the host
        tiny = _TINY[key] = torch.full(
            (1,), torch.finfo(z.dtype).tiny, dtype=z.dtype, device=z.device
        )
    meta = {"GAM_STRIDE": 0 if gam.numel() == 1 else 1, "K": k, "M": m, "N": 2**m}
    meta.update(MP=_pow2(m), KP=_pow2(k))
    if gam.numel() not in (1, g):
        raise ValueError(f"gamma must be 0-d or hold one value per gate ({g}), got {gam.numel()}")
    return gam, tiny, meta


def forward(z: Tensor, alpha: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor]:
    """(q̃ (G, N), entropies (G, K)) of z (G, K, M), α (G, K), γ (0-d or (G,))."""
    z, alpha = z.contiguous(), alpha.to(z).contiguous()
    g, k, m = z.shape
    gam, tiny, meta = _launch_args(z, gamma)
    out = torch.empty(g, 2**m, dtype=z.dtype, device=z.device)
    ent = torch.empty(g, k, dtype=z.dtype, device=z.device)
    if g:
        _kernels()[0][(g,)](z, alpha, gam, tiny, out, ent, **meta)
    return out, ent


def backward(
    z: Tensor, alpha: Tensor, gamma: Tensor, g_out: Tensor | None, g_ent: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """The gradients (z, α) of :func:`forward` given those of its outputs (either may be None:
    α's gradient is then None when ``g_out`` is)."""
    z, alpha = z.contiguous(), alpha.to(z).contiguous()
    g = z.shape[0]
    gam, tiny, meta = _launch_args(z, gamma)
    g_z = torch.empty_like(z)
    g_a = torch.empty_like(alpha) if g_out is not None else None
    if g:
        gout = g_out.to(z).contiguous() if g_out is not None else z
        gent = g_ent.to(z).contiguous() if g_ent is not None else z
        _kernels()[1][(g,)](
            z, alpha, gam, tiny, gout, gent, g_z, g_a if g_a is not None else z,
            HAS_GOUT=g_out is not None, HAS_GENT=g_ent is not None, **meta,
        )  # fmt: skip
    return g_z, g_a


class DSelectTriton(torch.autograd.Function):
    """(z (G, K, M), α (G, K), γ) -> (q̃ (G, N), entropies (G, K)) in one Triton kernel each way
    (module docstring); the interface of :class:`dselectk.kernels.aten._DSelectSmall`."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, alpha: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(z, alpha, gamma)
        return forward(z, alpha, gamma)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, g_out: Tensor | None, g_ent: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, None]:
        if g_out is None and g_ent is None:
            return None, None, None
        z, alpha, gamma = ctx.saved_tensors
        g_z, g_a = backward(z, alpha, gamma, g_out, g_ent)
        return g_z, g_a, None
