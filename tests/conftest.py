"""Shared test settings."""

from __future__ import annotations

import os

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
    from dselectk import functional as DF

    monkeypatch.setattr(DF, "FUSED_MIN_ELEMENTS", 0)
    monkeypatch.setattr(DF, "CUDA_SMALL_MAX_ELEMENTS", 0)
