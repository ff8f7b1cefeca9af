"""The one choice of DSelect-k's kernel for a problem, and the fused entry point.

:func:`choose` picks, for a problem of a given number of selector entries (gates × K × 2**M),
device, dtype and ``DSELECTK_KERNEL`` (:mod:`.setting`), what computes it:

* a DSelect-k gate's whole step in one node (its logits, or its input and linear layer, in;
  weights and entropy loss out), on CPU float32/float64 tensors in eager mode: numba's node
  (:mod:`.numba_nodes`) at every size, or NumPy's (:mod:`.host_numpy`, through
  :class:`.aten._DSelectSmallGate`) up to :data:`HOST_GATE_MAX_ELEMENTS`; else the gate's math
  as written, which comes back here for
* the formulation of :func:`dselect_k_fused` (weights and entropies of given α, Z, γ): the
  Triton kernels on CUDA (:mod:`.triton_cuda`), the small ATen kernel (which computes on the
  host in NumPy for CPU float32/float64), the fused ATen kernel (:mod:`.aten`) or the composed
  formulas of :mod:`dselectk.functional`, by device and size.

Every kernel computes the formulas of :mod:`dselectk.functional` (tested against them).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from dselectk.functional import _check_gamma, _dselect_k_composed
from dselectk.kernels import triton_cuda
from dselectk.kernels.aten import (
    _DSelectFused,
    _DSelectSmall,
    _DSelectSmallGate,
    _DSelectSmallGateLinear,
    _host_ok,
)
from dselectk.kernels.numba_nodes import _NumbaGate, _NumbaGateLinear
from dselectk.kernels.setting import _cpu_kernel

__all__ = [
    "CUDA_SMALL_MAX_ELEMENTS",
    "FUSED_MIN_ELEMENTS",
    "HOST_GATE_MAX_ELEMENTS",
    "SMALL_MAX_ELEMENTS",
    "TRITON_MAX_BITS",
    "choose",
    "dselect_k_fused",
]

#: at or below this many selector entries (gates × K × 2**M), :func:`dselect_k_fused` calls the
#: small-problem kernel (``_DSelectSmall``: ~35 ATen calls in one autograd node; the cost of a
#: few examples is the number of calls; on CPU float32/float64 NumPy calls, cheaper still, see
#: :mod:`.host_numpy`). Its work is O(N·M²) per selector, so larger problems go to the
#: composed formulas or the fused kernel (see ``benchmarks/small_batch.py``)
SMALL_MAX_ELEMENTS = 8192

#: below this many selector entries, :func:`dselect_k_fused` does not call the fused kernel
#: (``_DSelectFused``, O(N) per selector but ~90 ATen calls): the small kernel (up to
#: :data:`SMALL_MAX_ELEMENTS`) or the composed autograd formulas (above it) are faster there
FUSED_MIN_ELEMENTS = SMALL_MAX_ELEMENTS + 1

#: on a CUDA device without the Triton kernels (:data:`TRITON_MAX_BITS`), up to this many
#: selector entries go to the small kernel at every size: a
#: GPU step this small costs its kernel launches, not its arithmetic, and the small kernel
#: launches about half the fused kernel's (fwd + bwd of a gate with p = 64, n = 128, k = 4 on an
#: H200: 2.2 vs 3.1 ms at B = 4096, 2.3 vs 3.0 at B = 256; ``python -m benchmarks.gpu_gate``,
#: ``benchmarks/results/gpu/gpu_gate-86373fc.json``). Its transient memory is O(entries · M²)
#: (~350 MB at this bound with M = 7 bits), hence a bound: B = 4096 at K = 4, n = 128
CUDA_SMALL_MAX_ELEMENTS = 2**21


def _capturing() -> bool:
    """Whether a tracer or exporter records the ops into a graph for other batch sizes.

    (``torch.compile`` is not one: it guards on the shapes and takes the eager path's kernels,
    so compiled and eager numbers stay identical.)
    """
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()


#: up to this many selector entries, a :class:`~dselectk.gates.DSelectK` gate on CPU float32 or
#: float64 tensors (eager) computes in one autograd node on the host (``_DSelectSmallGate``,
#: NumPy; :mod:`.host_numpy`): below :data:`SMALL_MAX_ELEMENTS` the numbers of
#: :func:`dselect_k_fused` bit for bit (the same host kernel), above it (where that takes the
#: fused kernel) the same to float rounding. 2**18: B = 512 at K = 4, n = 128, where it is still
#: 2x faster than the fused kernel (B = 1024: as fast; measured on a 2-core EPYC)
HOST_GATE_MAX_ELEMENTS = 2**18


def _small_on_host(entries: int, logits: Tensor, gamma: Tensor) -> bool:
    """Whether :class:`~dselectk.gates.DSelectK` takes a problem of ``entries`` selector entries
    to the host in one node: CPU float32/float64 tensors, eager, and either a size that
    :func:`dselect_k_fused` gives to the small kernel (which then computes on the host too: the
    same numbers) or one above :data:`SMALL_MAX_ELEMENTS` up to :data:`HOST_GATE_MAX_ELEMENTS`."""
    return (  # the size last: under graph capture, a comparison with a dynamic size is a guard
        _host_ok(logits)  # (eager only: no tracer or exporter, see _capturing)
        and gamma.is_cpu
        and not gamma.requires_grad
        and 0 < entries
        and (
            (entries <= SMALL_MAX_ELEMENTS and entries < FUSED_MIN_ELEMENTS)
            or SMALL_MAX_ELEMENTS < entries <= HOST_GATE_MAX_ELEMENTS
        )
    )


#: the Triton kernels (:mod:`.triton_cuda`) take CUDA problems of at most this many bits
#: (N = 2**M codes per selector, held in one program's registers): up to 128 experts. Checked
#: compiled on an H200 at M = 1 and 7 (float32 and float64); at M = 10 (float64) the check failed
#: and the next one did not finish in its time, so M > 7 takes the ATen small kernel
TRITON_MAX_BITS = 7

_Kernel = type[_DSelectSmall] | type[_DSelectFused] | type[triton_cuda.DSelectTriton]


def _triton_ok(z: Tensor) -> bool:
    """Whether the Triton kernels may take ``z`` (..., K, M): CUDA float32/float64, at most
    :data:`TRITON_MAX_BITS` bits, Triton importable, eager (see :func:`.triton_cuda.available`)."""
    return (
        z.shape[-1] <= TRITON_MAX_BITS
        and not torch.compiler.is_compiling()
        and triton_cuda.available(z)
    )


def _kernel_for(entries: int, device: torch.device, triton_ok: bool = False) -> _Kernel | None:
    """The formulation :func:`dselect_k_fused` takes for ``entries`` selector entries on
    ``device``: on CUDA the Triton kernels (:mod:`.triton_cuda`) at every size when
    ``triton_ok`` (:func:`_triton_ok`), else the small kernel up to
    :data:`CUDA_SMALL_MAX_ELEMENTS`; elsewhere the small kernel, the composed formulas (None)
    or the fused kernel, by size."""
    if device.type == "cuda":
        if triton_ok:
            return triton_cuda.DSelectTriton
        if entries <= CUDA_SMALL_MAX_ELEMENTS:
            return _DSelectSmall
    if entries < FUSED_MIN_ELEMENTS:
        return _DSelectSmall if entries <= SMALL_MAX_ELEMENTS else None
    return _DSelectFused


def choose(
    entries: int,
    t: Tensor,
    gamma: float | Tensor,
    lam: Tensor | None = None,
    *,
    host_math: bool = True,
    linear: bool = False,
) -> Any:
    """The kernel that computes a DSelect-k problem of ``entries`` selector entries.

    With ``lam`` (λ, the entropy weight): a gate's whole step, ``t`` its logits (G, K(1+M)) or,
    with ``linear``, the input of its linear layer (the caller has checked first that ``t`` is
    an eager CPU float32/float64 tensor, :func:`.aten._host_ok`, so that graph capture traces
    nothing here). By ``DSELECTK_KERNEL`` (:func:`.setting._cpu_kernel`): ``numba``,
    :class:`.numba_nodes._NumbaGate` (``_NumbaGateLinear``) at every size; ``numpy``,
    :class:`.aten._DSelectSmallGate` (``_DSelectSmallGateLinear``) up to
    :data:`HOST_GATE_MAX_ELEMENTS` (:func:`_small_on_host`); both only where ``host_math`` (the
    nodes compute the gate's math: no ``distinct`` codes, no unused-code penalty), γ is on the
    CPU without a gradient (λ too, for numba) and there are entries. Else None: the gate's math
    as written.

    Without ``lam``: the formulation of :func:`dselect_k_fused`, ``t`` being Z (..., K, M):
    None (the composed formulas of :mod:`dselectk.functional`) where γ requires a gradient,
    under tracing or export (the composed formulas at every size: a branch on the size would
    tie the graph to the example's batch; comparing a dynamic batch with
    :data:`FUSED_MIN_ELEMENTS` records a guard, and an exported program refused batches above
    256) or without entries (the composed formulas' empty result); else by device and size
    (:func:`_kernel_for`).
    """
    if lam is not None:
        kernel = _cpu_kernel()
        if kernel == "numba":
            if host_math and isinstance(gamma, Tensor) and gamma.is_cpu and lam.is_cpu:
                if not gamma.requires_grad and entries > 0:
                    return _NumbaGateLinear if linear else _NumbaGate
        elif kernel == "numpy" and host_math and isinstance(gamma, Tensor):
            if _small_on_host(entries, t, gamma):
                return _DSelectSmallGateLinear if linear else _DSelectSmallGate
        return None
    if (isinstance(gamma, Tensor) and gamma.requires_grad) or _capturing() or not entries:
        return None
    return _kernel_for(entries, t.device, t.is_cuda and _triton_ok(t))


def dselect_k_fused(alpha: Tensor, z: Tensor, gamma: float | Tensor = 1.0) -> tuple[Tensor, Tensor]:
    """DSelect-k weights over all N = 2**M codes and the per-selector entropies, fused.

    Same numbers as ``dselect_k_weights(alpha, z, gamma)`` and
    ``selector_entropy(smooth_step(z, gamma))`` (tested, values and gradients), in one autograd
    node whose memory and time are O(N + K·sqrt(N)) per gate (``_DSelectFused`` in
    :mod:`.aten`, where a comment explains the algorithm). γ gets no
    gradient; a γ that requires one uses the composed formulation. Problems smaller than
    :data:`FUSED_MIN_ELEMENTS` use the small-problem kernel (``_DSelectSmall``, up to
    :data:`SMALL_MAX_ELEMENTS`) or the composed formulation. On a CUDA device the Triton kernels
    (:mod:`.triton_cuda`) take float32/float64 problems of at most
    :data:`TRITON_MAX_BITS` bits at every size, and otherwise the small kernel every problem up
    to :data:`CUDA_SMALL_MAX_ELEMENTS` (see :func:`choose`).

    Args:
        alpha: (..., K) selector logits.
        z: (..., K, M) encoding variables.
        gamma: smooth-step width γ > 0: a float, a 0-d tensor (e.g. a buffer a
            schedule updates in place), or a tensor broadcastable to the
            leading shape ``...`` (one γ per gate, e.g. a bank of gates tuned together).

    Returns:
        ``(weights (..., N), entropies (..., K))``.
    """
    _check_gamma(gamma)
    return _dselect_k_parts(alpha, z, gamma)


def _dselect_k_parts(alpha: Tensor, z: Tensor, gamma: float | Tensor) -> tuple[Tensor, Tensor]:
    """:func:`dselect_k_fused` without the check of ``gamma`` (a gate's γ buffer is validated
    when written): a γ on a GPU is not read back to the host (a device sync) every call. The
    gate's math (:meth:`dselectk.gates.DSelectK.gate`) calls it."""
    if alpha.shape[-1] != z.shape[-2]:
        raise ValueError(
            f"alpha has {alpha.shape[-1]} selectors but z has {z.shape[-2]} (expected alpha "
            f"(..., K) and z (..., K, M))"
        )
    lead = alpha.shape[:-1]
    if lead != z.shape[:-2]:
        lead = torch.broadcast_shapes(lead, z.shape[:-2])
    k, m = z.shape[-2:]
    kernel = choose(math.prod(lead) * k * 2**m, z, gamma)
    if kernel is None:
        return _dselect_k_composed(alpha, z, gamma)
    if isinstance(gamma, Tensor):
        g = gamma if gamma.dtype == z.dtype and gamma.device == z.device else gamma.to(z)
    else:
        g = torch.as_tensor(gamma, dtype=z.dtype, device=z.device)
    if g.dim() > 0:  # one γ per gate: flattened like the gates (the kernel's batch axis)
        g = g.expand(lead).reshape(-1)
    if alpha.shape[:-1] != lead:
        alpha = alpha.expand(*lead, alpha.shape[-1])
    if z.shape[:-2] != lead:
        z = z.expand(*lead, *z.shape[-2:])
    if kernel is _DSelectSmall and torch.compiler.is_compiling():
        # One operator of the graph that runs the eager kernel (on the CPU it computes in
        # NumPy): compiled and eager numbers stay identical, and nothing breaks the graph.
        from dselectk.kernels.compiled_small import small

        out, ent = small(z.reshape(-1, k, m), alpha.reshape(-1, k), g)
    else:
        out, ent = kernel.apply(z.reshape(-1, k, m), alpha.reshape(-1, k), g)[:2]
    return out.view(*lead, out.shape[-1]), ent.reshape(*lead, k)
