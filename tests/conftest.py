"""Shared test settings."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import settings

settings.register_profile("default", deadline=None, max_examples=60, derandomize=True)
settings.register_profile("ci", deadline=None, max_examples=60, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

torch.set_num_threads(min(2, torch.get_num_threads()))

if not torch.cuda.is_available():
    # Triton (when installed) decides at its import whether its kernels run compiled or in its
    # interpreter: without a GPU, tests/test_triton.py runs DSelect-k's Triton kernels there
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def always_fused_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make dselect_k_fused call its kernel at every size (FUSED_MIN_ELEMENTS = 0)."""
    from dselectk.kernels import dispatch

    monkeypatch.setattr(dispatch, "FUSED_MIN_ELEMENTS", 0)
    monkeypatch.setattr(dispatch, "CUDA_SMALL_MAX_ELEMENTS", 0)


@pytest.fixture
def numpy_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin DSelect-k's NumPy host kernel, which the gate takes when numba is not installed (with
    numba every size runs on its kernel; ``tests/test_numba_kernel.py`` checks that one)."""
    monkeypatch.setenv("DSELECTK_KERNEL", "numpy")


@pytest.fixture
def thread_spy(monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType], list[int]]:
    """``spy(module)`` wraps the host node's ``module._linear`` and ``module._linear_grads``
    and returns the list that records torch's intra-op thread count at each of their calls."""

    def spy(module: ModuleType) -> list[int]:
        seen: list[int] = []
        for name in ("_linear", "_linear_grads"):
            orig = getattr(module, name)

            def wrapped(*a: Any, _orig: Any = orig) -> Any:
                seen.append(torch.get_num_threads())
                return _orig(*a)

            monkeypatch.setattr(module, name, wrapped)
        return seen

    return spy
