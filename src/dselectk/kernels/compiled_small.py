"""The small DSelect-k kernel as one operator of a compiled graph (``torch.compile``).

Eager code calls the kernel (``dselectk.kernels.aten._DSelectSmall``) directly; on CPU
float32/float64 it computes on the host (NumPy or numba), which a compiler cannot trace. Under
``torch.compile`` :mod:`dselectk.kernels.dispatch` calls :func:`small` instead: a
``torch.library`` custom operator with a fake (shape-only) implementation and a backward
operator, so the whole model compiles to one graph (``fullgraph=True``) and the operator runs
the eager kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dselectk.kernels.aten import _DSelectSmall

__all__ = ["small"]


@torch.library.custom_op("dselectk::small", mutates_args=())
def small(z: Tensor, alpha: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor]:
    """(z (G, K, M), α (G, K), γ (0-d or (G,))) -> (q̃ (G, 2**M), entropies (G, K))."""
    out, ent = _DSelectSmall.apply(z, alpha, gamma)[:2]
    return out.clone(), ent.clone()  # an operator's outputs own their memory


@small.register_fake
def _(z: Tensor, alpha: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor]:
    g, k, m = z.shape
    return z.new_empty(g, 2**m), z.new_empty(g, k)


@torch.library.custom_op("dselectk::small_backward", mutates_args=())
def small_backward(
    z: Tensor, alpha: Tensor, gamma: Tensor, g_out: Tensor, g_ent: Tensor
) -> tuple[Tensor, Tensor]:
    """The eager kernel's gradients of z and α (its forward recomputed: small problems only)."""
    with torch.enable_grad():
        z_ = z.detach().requires_grad_()
        a_ = alpha.detach().requires_grad_()
        out, ent = _DSelectSmall.apply(z_, a_, gamma)[:2]
        g_z, g_a = torch.autograd.grad((out, ent), (z_, a_), (g_out, g_ent), allow_unused=True)
    return (
        torch.zeros_like(z) if g_z is None else g_z,
        torch.zeros_like(alpha) if g_a is None else g_a,
    )


@small_backward.register_fake
def _(
    z: Tensor, alpha: Tensor, gamma: Tensor, g_out: Tensor, g_ent: Tensor
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(z), torch.empty_like(alpha)


def _setup_context(ctx: object, inputs: tuple[Tensor, ...], output: object) -> None:
    ctx.save_for_backward(*inputs)  # type: ignore[attr-defined]


def _backward(ctx: object, g_out: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor | None, ...]:
    z, alpha, gamma = ctx.saved_tensors  # type: ignore[attr-defined]
    g, k, m = z.shape
    if g_out is None:
        g_out = z.new_zeros(g, 2**m)
    if g_ent is None:
        g_ent = z.new_zeros(g, k)
    g_z, g_a = small_backward(z, alpha, gamma, g_out, g_ent)
    return g_z, g_a, None


small.register_autograd(_backward, setup_context=_setup_context)
