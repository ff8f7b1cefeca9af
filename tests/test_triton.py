"""The Triton kernels of DSelect-k (``dselectk.kernels.triton_cuda``) against the ATen small kernel.

On a machine without CUDA they run in Triton's interpreter (``TRITON_INTERPRET=1``, NumPy on the
CPU): the same kernel code, so values and gradients are checked in CI; the GPU tests
(``tests/test_device.py``) run them compiled. Skipped when Triton does not import.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.is_available():  # pragma: no cover - the GPU tests cover the compiled kernels
    pytest.skip("the interpreter tests run on CPU-only machines", allow_module_level=True)

from _triton_check import assert_triton_matches_small_kernel
from dselectk import functional as DF
from dselectk.kernels import dispatch
from dselectk.kernels import triton_cuda as _triton
from dselectk.kernels.aten import _DSelectSmall

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - set by conftest.py
    pytest.skip("needs TRITON_INTERPRET=1 before triton's import", allow_module_level=True)


# (G, K, M); the interpreter runs a program per gate at ~20 s per (4, 4, 7) case, so the larger
# codes (up to M = 10) are checked on the GPU (tests/test_device.py)
SHAPES = [(3, 2, 3), (2, 3, 1), (2, 1, 2), (3, 3, 4), (2, 2, 6)]


def _inputs(g: int, k: int, m: int, dtype: torch.dtype, per_gate: bool):
    gen = torch.Generator().manual_seed(g * 100 + k * 10 + m)
    z = torch.randn(g, k, m, generator=gen, dtype=dtype) * 0.8
    z[0, 0, 0], z[-1, -1, -1] = 5.0, -3.0  # saturated bits: exact 0/1, zero factors
    alpha = torch.randn(g, k, generator=gen, dtype=dtype)
    gamma = torch.rand(g, generator=gen, dtype=dtype) + 0.5 if per_gate else torch.tensor(0.7)
    return z, alpha, gamma.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_gate", [False, True])
def test_kernels_match_the_aten_small_kernel(
    dtype: torch.dtype, shape: tuple[int, int, int], per_gate: bool
) -> None:
    assert_triton_matches_small_kernel(*_inputs(*shape, dtype, per_gate))


def test_autograd_node_gradcheck() -> None:
    """The node's gradients against finite differences (bits off the kinks at |z/γ| = 1/2)."""
    z = (torch.rand(2, 2, 2, dtype=torch.float64) - 0.5) * 0.6  # |z/γ| < 0.3: smooth region
    alpha = torch.randn(2, 2, dtype=torch.float64)
    z.requires_grad_(True)
    alpha.requires_grad_(True)
    gamma = torch.tensor(1.0, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda a, b: _triton.DSelectTriton.apply(a, b, gamma), (z, alpha), eps=1e-6, atol=1e-7
    )


def test_node_equals_the_composed_formulas_and_rows_sum_to_one() -> None:
    z, alpha, gamma = _inputs(4, 3, 4, torch.float64, False)
    z.requires_grad_(True)
    out, ent = _triton.DSelectTriton.apply(z, alpha, gamma)
    torch.testing.assert_close(out.sum(-1), torch.ones(4, dtype=torch.float64))
    p = DF.smooth_step(z, gamma)
    torch.testing.assert_close(ent, DF.selector_entropy(p))
    w = DF.dselect_k_weights(alpha, z, gamma)
    torch.testing.assert_close(out, w)
    (gz,) = torch.autograd.grad(out.square().sum(), z)
    (gz_ref,) = torch.autograd.grad(w.square().sum(), z)
    torch.testing.assert_close(gz, gz_ref)


def test_availability_and_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton takes CUDA tensors only (never CPU ones), obeys DSELECTK_TRITON=0, and the CUDA
    rule prefers it at every size when allowed."""
    assert not _triton.available(torch.zeros(2, 2, 3))
    cuda = torch.device("cuda")
    assert dispatch._kernel_for(10**9, cuda, triton_ok=True) is _triton.DSelectTriton
    assert dispatch._kernel_for(8, cuda, triton_ok=False) is _DSelectSmall
    assert dispatch._kernel_for(8, torch.device("cpu"), triton_ok=True) is _DSelectSmall
    monkeypatch.setenv("DSELECTK_TRITON", "0")
    assert not _triton.available(torch.zeros(2, 2, 3))


def test_bad_gamma_shape_is_refused() -> None:
    z, alpha, _ = _inputs(4, 2, 3, torch.float64, False)
    with pytest.raises(ValueError, match="gamma must be 0-d or hold one value per gate"):
        _triton.forward(z, alpha, torch.ones(3, dtype=torch.float64))
