"""DSelect-k's kernels: every implementation of the gate's math, and the one choice between them.

The formulas are :mod:`dselectk.functional`'s; the kernels compute the same numbers (tested
against them) faster, each where it pays:

* :mod:`~dselectk.kernels.aten`: hand-written autograd nodes of ATen calls: the fused kernel
  (O(N) per selector, large problems), the small kernel (few calls, small problems), the
  one-node gate steps and the softmax-selector ablation's node;
* :mod:`~dselectk.kernels.host_numpy`: the small kernel's arithmetic in NumPy on the host (CPU
  float32/float64: a NumPy call costs less than an ATen call);
* :mod:`~dselectk.kernels.numba_cpu` (the ``fast`` extra): the compiled CPU kernel, every size
  on one thread, and :mod:`~dselectk.kernels.numba_nodes`, its autograd nodes and
  :func:`warm_kernels`;
* :mod:`~dselectk.kernels.triton_cuda`: two Triton kernels for CUDA (Triton comes with CUDA
  builds of torch; ``DSELECTK_TRITON=0`` turns them off).

:func:`~dselectk.kernels.dispatch.choose` picks one for a problem (device, dtype, size, and the
``DSELECTK_KERNEL`` setting of :mod:`~dselectk.kernels.setting`: ``auto``, ``numba``, ``numpy``
or ``aten``); :func:`dselect_k_fused` is DSelect-k's weights and entropies through it.
"""

from __future__ import annotations

from dselectk.kernels.dispatch import choose, dselect_k_fused
from dselectk.kernels.numba_nodes import warm_kernels
from dselectk.kernels.setting import KERNEL_ENV

__all__ = ["KERNEL_ENV", "choose", "dselect_k_fused", "warm_kernels"]
