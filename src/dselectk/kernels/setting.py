"""``DSELECTK_KERNEL``, the setting that picks DSelect-k's CPU kernel, and numba's loading.

Which CPU kernel a :class:`~dselectk.gates.DSelectK` gate uses (CPU float32/float64 tensors,
eager: no torch.func transform, graph capture or compilation, γ without a gradient; the
gate's own math without ``distinct`` codes or the unused-code penalty) is read from the
environment variable ``DSELECTK_KERNEL`` at each call (:func:`_cpu_kernel`; the choice of a
kernel for a problem is :func:`dselectk.kernels.dispatch.choose`):

* unset, empty or ``auto``: ``numba`` when numba is installed (``pip install dselectk[fast]``),
  else ``numpy``;
* ``numba``: the compiled kernel at every size, on the calling thread (one thread; the gate's
  linear layer runs on one intra-op thread too). Raises ``ImportError`` naming the ``fast``
  extra when numba is missing;
* ``numpy``: the NumPy host kernel up to
  :data:`~dselectk.kernels.dispatch.HOST_GATE_MAX_ELEMENTS` selector entries, the ATen kernels
  above (what the package does without numba);
* ``aten``: the ATen kernels at every size (no host kernel).

Any other value raises ``ValueError`` naming the variable. The numba kernel
(:mod:`dselectk.kernels.numba_cpu`) compiles on its first call in a process, once per dtype, and
caches the machine code on disk (numba's ``cache=True``): in ``$NUMBA_CACHE_DIR`` when set (a
writable folder for read-only installs and containers), else next to the kernel's source file
when that folder is writable, else in numba's per-user cache folder (``~/.cache/numba`` on
Linux). Where none of them can be written (a read-only install run by a user without a
writable home), the kernel compiles in memory in each process instead, with one
``RuntimeWarning`` naming ``NUMBA_CACHE_DIR`` (:func:`_cache_warning`); a computation never
fails for want of a cache. Measured on a 2-core EPYC at load 1.5: with nothing cached the
first float32 call compiles for 31 s (forward 13.7 s, backward 16.9 s; float64 28 s more), and
warns (RuntimeWarning) that it did; with the cache the first call takes 0.5 s, plus 0.3 s to
import numba. Each fresh process compiles unless the cache is warm when it starts (numba writes
its files atomically: concurrent workers are safe, only slow): call
:func:`~dselectk.kernels.warm_kernels` once before starting worker processes.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from typing import Any

__all__ = ["KERNEL_ENV"]

#: the environment variable that picks the DSelect-k gate's CPU kernel (module docstring)
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
    """Import :mod:`dselectk.kernels.numba_cpu` (and numba); an ``ImportError`` that says what
    to do when numba is missing or broken (never a silent fall back to another kernel). Where
    numba cannot write its cache the module compiles without one (one warning)."""
    global _numba_module
    if _numba_module is None:
        try:  # (a leaf module: it imports numba and numpy only, so no import cycle)
            module = importlib.import_module(f"{__package__}.numba_cpu")
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
        _numba_module = module
        if not module.CACHE:
            _cache_warning("no folder for its cache is writable")
    return _numba_module


#: whether numba's on-disk cache failed in this process (then the kernel compiles in memory)
_cache_failed: list[bool] = [False]


def _cache_warning(why: str) -> None:
    """Warn, once per process, that numba cannot write its cache and the kernel compiles in
    memory instead (the computation goes on)."""
    if _cache_failed[0]:
        return
    _cache_failed[0] = True
    warnings.warn(
        f"dselectk: numba cannot cache the compiled DSelect-k kernel ({why}), so it compiles "
        "in memory in each process (about 30 s for float32 on a 2-core CPU); set "
        "NUMBA_CACHE_DIR to a writable folder to cache it, or DSELECTK_KERNEL=numpy to use "
        "the NumPy kernel",
        RuntimeWarning,
        stacklevel=3,
    )
