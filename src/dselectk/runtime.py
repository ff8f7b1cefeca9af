"""Process-level settings for fast CPU training.

PyTorch's CPU allocator takes every tensor from the C library's ``malloc``. glibc serves
blocks above a threshold (128 KiB at first, adapting up to 32 MiB) with ``mmap`` and returns
them to the operating system on ``free``, so a training loop that allocates the same large
activations every step page-faults (and has the kernel zero) each of them again every step.
For the small, allocation-heavy models of this package that is 20-30 % of a step (measured:
the per-example gate benchmark 11.2 -> 7.8 ms fwd+bwd). PyTorch's CPU tuning guide recommends
swapping the allocator (jemalloc, tcmalloc) for the same reason; :func:`tune_allocator` gets most
of the gain with glibc's own ``mallopt``, without a dependency.

This module holds the process's thread policy (below), the allocator (:func:`tune_allocator`),
and :func:`exit_with_parent` for worker processes. DSelect-k's kernels and the
``DSELECTK_KERNEL`` setting live in :mod:`dselectk.kernels`.

The thread policy. torch runs an op's parallel region on its OpenMP pool, and every region ends
in a barrier that waits for the slowest thread. Beside other busy processes one of the pool's
threads is often descheduled, and a step of small ops then takes 4-40x its idle time, while
idle two threads gain little on small ops. So the package decides, by the size of the work:

* the DSelect-k kernels (:mod:`dselectk.kernels`: the numba and NumPy nodes, the gate's linear
  layer inside them, the ATen kernels below :data:`PARALLEL_MIN_ELEMENTS` selector entries) run
  on one intra-op thread (the calling thread);
* :func:`~dselectk.training.train` with ``TrainConfig(threads="auto")`` and
  :func:`thread_policy` (for a loop of your own) run a step of less than
  :data:`PARALLEL_MIN_WORK` (batch x trainable parameters) on one thread;
* larger work runs on torch's count capped to the CPUs this process may use
  (:func:`cpu_quota`: its CPU affinity and its cgroup's CPU quota; torch's default pool counts
  the affinity, not a container's quota).

The system load average is not used: it lags a minute and, in a container, counts the whole
host's processes. Override with the environment variable ``DSELECTK_THREADS`` (read when
``dselectk.runtime`` is imported) or :func:`set_thread_policy` at run time: ``auto`` (the
default, the rules above), an int ``n`` (every one of the rules uses ``n`` threads) or ``torch``
(the package never changes torch's thread count; you choose it with ``torch.set_num_threads``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = [
    "PARALLEL_MIN_ELEMENTS",
    "PARALLEL_MIN_WORK",
    "THREADS_ENV",
    "cpu_quota",
    "exit_with_parent",
    "intra_op_threads",
    "policy_threads",
    "set_thread_policy",
    "thread_policy",
    "thread_policy_setting",
    "tune_allocator",
]

#: problems with fewer elements than this run their ops on one thread inside the package's
#: kernels (:func:`intra_op_threads` with ``elements``). Below it an OpenMP parallel region
#: buys little (a 2-core CPU: DSelect-k at B = 4096 is 10.4 ms on 2 threads vs 11.8 ms on 1)
#: and every region ends in a barrier that waits for the slowest thread: beside busy processes
#: that thread is often descheduled, and a step of tiny ops then takes 10-40x its idle time
#: (measured: the per-example gate at B = 1, 2 threads, load 7.7: 28 ms vs 2.1 ms on 1 thread).
PARALLEL_MIN_ELEMENTS = 2**22

#: :func:`thread_policy` and ``TrainConfig(threads="auto")`` run a step on one intra-op thread
#: below this much work (batch size x trainable parameters, about the multiply-adds of a forward
#: pass). Measured with ``scripts/measure_train_threads.py`` (a 2-task MMoE of 8 experts, 2-core
#: CPU beside busy processes, load 12-14), ms per step on 2 threads / on 1: 25x at work 8e4, 26x
#: at 1.1e6, 15x at 8.7e6, 8.2x at 6.8e7, 2.8x at 5.4e8, 1.3x at 2.2e9. Idle, two threads gain
#: at most ~1.1-1.6x, and only on large steps; so below 2**28 (2.7e8) one thread.
PARALLEL_MIN_WORK = 2**28

#: the environment variable that overrides the thread policy (module docstring)
THREADS_ENV = "DSELECTK_THREADS"


def _parse_policy(value: object, name: str) -> int | str:
    """``"auto"``, ``"torch"`` or an int >= 1 from a setting's value (a ValueError otherwise)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be 'auto', 'torch' or an int >= 1, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{name} must be 'auto', 'torch' or an int >= 1, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be 'auto', 'torch' or an int >= 1, got {type(value).__name__}"
        )
    text = value.strip().lower()
    if text in ("", "auto"):
        return "auto"
    if text == "torch":
        return "torch"
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"{name} must be 'auto', 'torch' or an int >= 1, got {value!r}")


_policy: int | str = _parse_policy(os.environ.get(THREADS_ENV, "auto"), THREADS_ENV)
#: the thread count of the kernels' small problems (``_OneThread``): 1 under "auto", n under an
#: int n, 0 under "torch" (no change)
_small_threads = 1 if _policy == "auto" else (0 if _policy == "torch" else int(_policy))


def set_thread_policy(value: int | str = "auto") -> int | str:
    """Set the package's thread policy at run time (module docstring): ``"auto"``, ``"torch"``
    or an int n >= 1 (``"2"`` too). Overrides ``DSELECTK_THREADS``.

    Returns:
        The previous setting (to restore it).

    Raises:
        ValueError, TypeError: any other value.

    Example:
        >>> from dselectk.runtime import set_thread_policy, thread_policy_setting
        >>> before = set_thread_policy("torch")  # the package leaves torch's threads alone
        >>> thread_policy_setting()
        'torch'
        >>> _ = set_thread_policy(before)
    """
    global _policy, _small_threads
    new = _parse_policy(value, "thread policy")
    old, _policy = _policy, new
    _small_threads = 1 if new == "auto" else (0 if new == "torch" else int(new))
    return old


def thread_policy_setting() -> int | str:
    """The current thread policy: ``"auto"``, ``"torch"`` or an int n.

    Example:
        >>> from dselectk.runtime import thread_policy_setting
        >>> thread_policy_setting() in ("auto", "torch") or thread_policy_setting() >= 1
        True
    """
    return _policy


def _read_words(path: str) -> list[str]:
    """The whitespace-separated words of a small text file ([] when it cannot be read)."""
    try:
        with open(path) as fh:
            return fh.read().split()
    except OSError:
        return []


def _cgroup_cpus(
    cgroup_file: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> float | None:
    """This process's cgroup CPU quota in CPUs (cgroup v2 ``cpu.max``, v1 ``cfs_quota_us`` /
    ``cfs_period_us``), None without a quota or where it cannot be read (not Linux)."""
    try:
        with open(cgroup_file) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        rel = parts[2].strip("/")
        if parts[0] == "0":  # v2: "quota period", or "max period"
            dirs = [f"{root}/{rel}", root] if rel else [root]
            for folder in dirs:
                words = _read_words(f"{folder}/cpu.max")
                if len(words) >= 2:
                    if words[0] == "max":
                        return None
                    try:
                        return int(words[0]) / int(words[1])
                    except (ValueError, ZeroDivisionError):
                        return None
        elif "cpu" in parts[1].split(","):  # v1: quota -1 means none
            base = f"{root}/{parts[1]}"
            for folder in ([f"{base}/{rel}"] if rel else []) + [base]:
                quota, period = (
                    _read_words(f"{folder}/cpu.cfs_{n}_us") for n in ("quota", "period")
                )
                if quota and period:
                    try:
                        q, t = int(quota[0]), int(period[0])
                    except ValueError:
                        return None
                    return q / t if q > 0 and t > 0 else None
    return None


_cpu_quota: int | None = None


def cpu_quota() -> int:
    """The CPUs this process may use: its CPU affinity (``os.sched_getaffinity``, else
    ``os.cpu_count()``), capped by its cgroup's CPU quota rounded up (a container limited to
    2.5 CPUs: 3). Read once per process.

    Example:
        >>> import os
        >>> from dselectk.runtime import cpu_quota
        >>> 1 <= cpu_quota() <= (os.cpu_count() or 1)
        True
    """
    global _cpu_quota
    if _cpu_quota is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        quota = _cgroup_cpus()
        if quota is not None and quota > 0:
            cpus = min(cpus, max(1, math.ceil(quota)))
        _cpu_quota = max(1, cpus)
    return _cpu_quota


def policy_threads(work: int | None = None) -> int | None:
    """The intra-op thread count the policy gives a step of ``work`` (batch x trainable
    parameters; None: large work), or None where torch's current count stays.

    ``"auto"``: 1 below :data:`PARALLEL_MIN_WORK`; else torch's count capped to
    :func:`cpu_quota` (None when that is the current count). An int n: n. ``"torch"``: None.

    Example:
        >>> from dselectk.runtime import PARALLEL_MIN_WORK, policy_threads, set_thread_policy
        >>> before = set_thread_policy("auto")
        >>> policy_threads(work=256 * 50_000)  # a small step: one thread
        1
        >>> _ = set_thread_policy(before)
    """
    if _policy == "torch":
        return None
    if isinstance(_policy, int):
        return _policy
    if work is not None and work < PARALLEL_MIN_WORK:
        return 1
    current = torch.get_num_threads()
    capped = min(current, cpu_quota())
    return None if capped == current else capped


class thread_policy:
    """``with thread_policy(work):`` runs the enclosed step on :func:`policy_threads` (work)
    intra-op threads, then restores torch's count (what :func:`~dselectk.training.train` does
    with ``TrainConfig(threads="auto")``, for a training loop of your own). Costs ~1 µs when
    nothing changes.

    Example:
        >>> import torch
        >>> from dselectk.runtime import thread_policy
        >>> with thread_policy(work=128 * 10_000):  # a small step: one thread
        ...     torch.get_num_threads()
        1
    """

    __slots__ = ("before", "threads")

    def __init__(self, work: int | None = None) -> None:
        self.threads = policy_threads(work)
        self.before = 0

    def __enter__(self) -> int:
        self.before = before = torch.get_num_threads()
        if self.threads is not None and self.threads != before:
            torch.set_num_threads(self.threads)
            return self.threads
        return before

    def __exit__(self, *exc: object) -> None:
        if torch.get_num_threads() != self.before:
            torch.set_num_threads(self.before)


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
    problems take :func:`policy_threads`: the current thread count capped to
    :func:`cpu_quota`), and follows the thread policy (module docstring): an int policy n
    gives n threads at every size, ``"torch"`` changes nothing. The switch costs a few microseconds
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
    if elements is None:
        limit = min(threads, before)
    elif _policy == "torch":
        limit = before
    elif isinstance(_policy, int):
        limit = _policy
    elif elements < PARALLEL_MIN_ELEMENTS:
        limit = min(threads, before)
    else:
        limit = policy_threads() or before
    limit = max(1, limit)
    if limit == before:
        yield before
        return
    torch.set_num_threads(limit)
    try:
        yield limit
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
        small = _small_threads  # the policy's count for small problems (0: leave torch's)
        if small and before != small:
            torch.set_num_threads(small)
        else:
            self.before = 0

    def __exit__(self, *exc: object) -> None:
        if self.before:
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
