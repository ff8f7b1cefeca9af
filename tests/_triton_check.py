"""Shared check of tests/test_triton.py (interpreter) and tests/test_device.py (GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dselectk import _triton
from dselectk._kernels import _DSelectSmall


def assert_triton_matches_small_kernel(
    z: torch.Tensor, alpha: torch.Tensor, gamma: torch.Tensor
) -> None:
    """``dselectk._triton``'s forward and backward equal the ATen small kernel's on the same
    device: values, and the gradients for each of (both outputs, the weights, the entropies)."""
    out, ent = _triton.forward(z, alpha, gamma)
    ref = _DSelectSmall._forward(z, alpha, gamma)
    torch.testing.assert_close(out, ref[0])
    torch.testing.assert_close(ent, ref[1])
    gen = torch.Generator(device=z.device).manual_seed(1)
    g_out = torch.randn(out.shape, generator=gen, device=z.device, dtype=z.dtype)
    g_ent = torch.randn(ent.shape, generator=gen, device=z.device, dtype=z.dtype)
    for go, ge in ((g_out, g_ent), (g_out, None), (None, g_ent)):
        ctx = SimpleNamespace(saved_tensors=(gamma, *ref[2:]))
        ref_z, ref_a, _ = _DSelectSmall._backward(ctx, go, ge)
        g_z, g_a = _triton.backward(z, alpha, gamma, go, ge)
        torch.testing.assert_close(g_z, ref_z)
        assert (g_a is None) == (ref_a is None)
        if g_a is not None:
            torch.testing.assert_close(g_a, ref_a)
