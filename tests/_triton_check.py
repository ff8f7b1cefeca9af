"""Shared check of tests/test_triton.py (interpreter) and tests/test_device.py (GPU); its two
kernel wrappers also serve scripts/triton_accuracy.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from dselectk.kernels import triton_cuda as _triton
from dselectk.kernels.aten import _DSelectSmall


def small_kernel(z: Tensor, alpha: Tensor, gamma: Tensor, go: Tensor | None, ge: Tensor | None):
    """(q̃, entropies, ∂z, ∂α) of the ATen small kernel."""
    ref = _DSelectSmall._forward(z, alpha, gamma)
    ctx = SimpleNamespace(saved_tensors=(gamma, *ref[2:]))
    g_z, g_a, _ = _DSelectSmall._backward(ctx, go, ge)
    return ref[0], ref[1], g_z, g_a


def triton_kernels(z: Tensor, alpha: Tensor, gamma: Tensor, go: Tensor | None, ge: Tensor | None):
    """(q̃, entropies, ∂z, ∂α) of the Triton kernels."""
    out, ent = _triton.forward(z, alpha, gamma)
    return out, ent, *_triton.backward(z, alpha, gamma, go, ge)


def _assert_as_accurate(got: Tensor, ref: Tensor, truth: Tensor, what: str) -> None:
    """float32: ``got`` is as close to the float64 ``truth`` as the ATen kernel's ``ref`` is
    (within 4× its error plus 16 ulps of the largest value). Both kernels round p = S(z/γ)
    near 1 and form q = 1 - p by subtraction, so a bit within ~1e-7 of saturation has q = 0
    in float32 and a log(q) far from the true one: its entropy gradient can be off by 5×
    in both kernels alike (seen on an H200: 0.0552 against 0.0110; README, "On a GPU"). An
    indexing or formula error is off by the values' own size."""
    err_got = (got.double() - truth).abs().max().item()
    err_ref = (ref.double() - truth).abs().max().item()
    bound = 4 * err_ref + 16 * torch.finfo(got.dtype).eps * truth.abs().max().item()
    assert err_got <= bound, (
        f"{what}: Triton's error {err_got:.3g} > {bound:.3g} (ATen's {err_ref:.3g})"
    )


def assert_triton_matches_small_kernel(z: Tensor, alpha: Tensor, gamma: Tensor) -> None:
    """``dselectk.kernels.triton_cuda``'s forward and backward against the ATen small kernel's
    on the same device: values, and the gradients for each of (both outputs, the weights, the
    entropies). float64: equal to rounding. float32: as accurate as the ATen kernel against
    float64 on the same inputs (the two order their float32 roundings differently on a GPU)."""
    gen = torch.Generator(device=z.device).manual_seed(1)
    shape_out = (z.shape[0], 2 ** z.shape[2])
    g_out = torch.randn(shape_out, generator=gen, device=z.device, dtype=z.dtype)
    g_ent = torch.randn(z.shape[:2], generator=gen, device=z.device, dtype=z.dtype)
    for go, ge in ((g_out, g_ent), (g_out, None), (None, g_ent)):
        args = (z, alpha, gamma, go, ge)
        got, ref = triton_kernels(*args), small_kernel(*args)
        assert (got[3] is None) == (ref[3] is None)
        if z.dtype == torch.float64:
            for a, b in zip(got, ref):
                if a is not None:
                    torch.testing.assert_close(a, b)
            continue
        truth = small_kernel(*(t.double() if t is not None else None for t in args))
        for name, a, b, t in zip(("q", "entropy", "dz", "dalpha"), got, ref, truth):
            if a is not None:
                _assert_as_accurate(a, b, t, name)
