"""Process-level settings for fast CPU training.

PyTorch's CPU allocator takes every tensor from the C library's ``malloc``. glibc serves
blocks above a threshold (128 KiB at first, adapting up to 32 MiB) with ``mmap`` and returns
them to the operating system on ``free``, so a training loop that allocates the same large
activations every step page-faults (and has the kernel zero) each of them again every step.
For the small, allocation-heavy models of this package that is 20-30 % of a step (measured:
the per-example gate benchmark 11.2 -> 7.8 ms fwd+bwd). PyTorch's CPU tuning guide recommends
swapping the allocator (jemalloc, tcmalloc) for the same reason; :func:`tune_allocator` gets most
of the gain with glibc's own ``mallopt``, without a dependency.

This module holds the process's threads (:func:`intra_op_threads`, one intra-op thread for small
products) and the allocator (:func:`tune_allocator`), and :func:`exit_with_parent` for worker
processes. DSelect-k's kernels and the ``DSELECTK_KERNEL`` setting live in
:mod:`dselectk.kernels`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = [
    "PARALLEL_MIN_ELEMENTS",
    "exit_with_parent",
    "intra_op_threads",
    "tune_allocator",
]

#: problems with fewer elements than this run their ops on one thread inside the package's
#: kernels (:func:`intra_op_threads` with ``elements``). Below it an OpenMP parallel region
#: buys little (a 2-core CPU: DSelect-k at B = 4096 is 10.4 ms on 2 threads vs 11.8 ms on 1)
#: and every region ends in a barrier that waits for the slowest thread: beside busy processes
#: that thread is often descheduled, and a step of tiny ops then takes 10-40x its idle time
#: (measured: the per-example gate at B = 1, 2 threads, load 7.7: 28 ms vs 2.1 ms on 1 thread).
PARALLEL_MIN_ELEMENTS = 2**22


# What to set on a shared or busy machine (measured with ``python -m benchmarks --only
# small_batch``, 2-core EPYC, 3 busy processes): the package's DSelect-k kernels already run
# small problems on one thread, but the ops around them (the gate's nn.Linear and its backward,
# the rest of a model) still open 2-thread parallel regions, and a per-example gate step at
# B = 16 took 141 ms there against 2.6 ms with the whole step inside ``intra_op_threads(1)``
# (Top-k: 244 ms). So for small batches beside other processes, train on one thread
# (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``, or this context manager around the step);
# give a process several threads only when its ops are large and the cores are its own.


@contextmanager
def intra_op_threads(threads: int = 1, *, elements: int | None = None) -> Iterator[int]:
    """Run the enclosed torch ops on at most ``threads`` intra-op threads, then restore.

    With ``elements``, the limit applies only below :data:`PARALLEL_MIN_ELEMENTS` (larger
    problems keep the current thread count). The switch costs a few microseconds
    (``torch.set_num_threads``); it is skipped when nothing changes. It holds for the calling
    thread, which on the CPU is also the thread that runs the backward pass of its graph.

    Yields:
        The number of threads in effect inside the block.

    Examples:
        >>> import torch
        >>> from dselectk.runtime import intra_op_threads
        >>> before = torch.get_num_threads()
        >>> with intra_op_threads(1) as n:
        ...     y = torch.randn(64, 32) @ torch.randn(32, 8)  # (64, 8), on one thread
        ...     n, torch.get_num_threads(), y.shape
        (1, 1, torch.Size([64, 8]))
        >>> with intra_op_threads(1, elements=2**24) as n:  # a large problem keeps its threads
        ...     n == before
        True
        >>> torch.get_num_threads() == before
        True
    """
    before = torch.get_num_threads()
    limit = threads if elements is None or elements < PARALLEL_MIN_ELEMENTS else before
    if limit >= before:
        yield before
        return
    torch.set_num_threads(max(1, limit))
    try:
        yield max(1, limit)
    finally:
        torch.set_num_threads(before)


class _OneThread:
    """``with _OneThread():`` runs the enclosed torch ops on one intra-op thread, then restores
    the count: :func:`intra_op_threads` (1) for the hot paths of the small kernels (a class costs
    ~0.5 µs a use, the generator-based context manager ~4 µs). Beside busy processes a 2-thread
    MKL product of a small gate's linear layer took 30-50 ms instead of 30-60 µs (its OpenMP
    barrier waits for a descheduled thread); on one thread it is also faster when idle."""

    __slots__ = ("before",)

    def __enter__(self) -> None:
        self.before = before = torch.get_num_threads()
        if before > 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.before > 1:
            torch.set_num_threads(self.before)


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum on 64-bit systems
_TRIM_THRESHOLD = 2**31 - 1

_tuned: bool | None = None


def tune_allocator() -> bool:
    """Keep freed large blocks in the process heap instead of returning them to the OS.

    Sets glibc's ``M_MMAP_THRESHOLD`` to 32 MiB and ``M_TRIM_THRESHOLD`` to 2 GiB, so blocks
    up to 32 MiB are reused from the heap. The process keeps its peak heap size instead of
    shrinking after each step. Called by the ``dselectk`` command and the benchmarks; call it
    yourself at the start of a training script. Safe to call more than once.

    Returns:
        True if the settings were applied; False on systems without glibc (macOS, Windows,
        musl), where nothing changes.

    Examples:
        >>> from dselectk.runtime import tune_allocator
        >>> applied = tune_allocator()  # once, at the start of a training script
        >>> tune_allocator() == applied  # safe to call again
        True
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        _tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
            mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
        )
    return _tuned


_PR_SET_PDEATHSIG = 1


def exit_with_parent(parent_pid: int) -> bool:
    """Have the kernel send this process SIGTERM when its parent dies (Linux ``prctl``).

    For worker processes of a sweep: if the sweep's main process is killed (even with
    ``kill -9``), its workers stop too instead of training on as orphans. What they had
    finished is already saved (records are written atomically), so the same command resumes.
    Exits at once if the parent is already gone (``parent_pid`` is the parent's pid as the
    parent saw it, to close the race between start-up and this call).

    Returns:
        True if set; False where ``prctl`` is unavailable (not Linux), where nothing changes.

    Examples:
        >>> import os
        >>> from concurrent.futures import ProcessPoolExecutor
        >>> from dselectk.runtime import exit_with_parent
        >>> init = dict(initializer=exit_with_parent, initargs=(os.getpid(),))
        >>> with ProcessPoolExecutor(1, **init) as pool:
        ...     pool.submit(pow, 2, 10).result()  # the workers stop if this process dies
        1024
    """
    if os.getppid() != parent_pid:
        os._exit(1)
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return False
    ok = prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    return ok
