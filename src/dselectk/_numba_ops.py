"""Scalar operations of the numba kernels (:mod:`dselectk._numba`) that keep loops vectorisable.

A branch-free select (an LLVM ``select``: numba compiles ``a if c else b`` to a branch, which
mispredicts on mixed data and stops LLVM's loop vectoriser), and the float32 log in plain
arithmetic and bit operations (libm's ``logf`` is a call per number); ``_log`` picks it for
float32 and libm's log for float64. Imports numba and numpy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

__all__: list[str] = []


def _f32_bits_typing(typingctx: Any, x: Any) -> Any:  # pragma: no cover - compiled
    """The bits of a float32 as an int32 (an LLVM bitcast)."""
    if x != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(types.int32))

    return types.int32(types.float32), codegen


def _bits_f32_typing(typingctx: Any, x: Any) -> Any:  # pragma: no cover - compiled
    """The float32 whose bits are the low 32 bits of an int32 or int64 (an LLVM bitcast)."""
    if x not in (types.int32, types.int64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v = args[0]
        if x == types.int64:
            v = builder.trunc(v, context.get_value_type(types.int32))
        return builder.bitcast(v, context.get_value_type(types.float32))

    return types.float32(x), codegen


def _lt_select_typing(typingctx: Any, x: Any, y: Any, a: Any, b: Any) -> Any:
    """``a if x < y else b`` without a branch (an LLVM fcmp and select: loops over it vectorise;
    a NaN x or y gives b)."""
    if not (isinstance(x, types.Float) and x == y == a == b):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.select(builder.fcmp_ordered("<", args[0], args[1]), args[2], args[3])

    return x(x, x, x, x), codegen


_lt_select: Any = intrinsic(_lt_select_typing)
_f32_bits: Any = intrinsic(_f32_bits_typing)
_bits_f32: Any = intrinsic(_bits_f32_typing)


@njit(cache=True, nogil=True, inline="always")
def _logf(x: Any) -> Any:  # pragma: no cover - compiled
    """log of a positive normal float32: Cephes' ``logf`` (frexp, a degree-9 polynomial on
    [√½ - 1, √2 - 1]; within 1 ulp of the correctly rounded log, tested), in plain arithmetic
    and bit operations, so loops over it vectorise (libm's ``logf`` is a call per number)."""
    b = _f32_bits(x)
    e = (b >> 23) - 126  # x = m 2**e, m in [1/2, 1)
    m = _bits_f32((b & 0x007FFFFF) | 0x3F000000)
    small = np.float32(m < np.float32(0.70710678118654752))  # then m 2**e = (2m) 2**(e-1)
    e = np.float32(e) - small
    m = m + m * small - np.float32(1.0)
    z = m * m
    y = np.float32(7.0376836292e-2)
    y = y * m + np.float32(-1.1514610310e-1)
    y = y * m + np.float32(1.1676998740e-1)
    y = y * m + np.float32(-1.2420140846e-1)
    y = y * m + np.float32(1.4249322787e-1)
    y = y * m + np.float32(-1.6668057665e-1)
    y = y * m + np.float32(2.0000714765e-1)
    y = y * m + np.float32(-2.4999993993e-1)
    y = y * m + np.float32(3.3333331174e-1)
    y = y * m * z
    y = y + e * np.float32(-2.12194440e-4)
    y = y - np.float32(0.5) * z
    return m + y + e * np.float32(0.693359375)


def _log(x: Any) -> Any:
    """log x for x >= the dtype's smallest normal number (typed per dtype below)."""
    return np.log(x)


@overload(_log, inline="always")
def _log_typed(x: Any) -> Any:  # pragma: no cover - compiled
    if x == types.float32:

        def impl(x: Any) -> Any:
            return _logf(x)

    else:

        def impl(x: Any) -> Any:
            return np.log(x)

    return impl
