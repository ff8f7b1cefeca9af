"""Fixtures for the data-loader tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from datahelpers import REAL_DATA


@pytest.fixture
def real_data() -> Path:
    """Path of the real data; skips the test when it is absent."""
    if not REAL_DATA.is_dir():
        pytest.skip(f"real data not found at {REAL_DATA}")
    return REAL_DATA


@pytest.fixture(autouse=True)
def _no_env_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make tests independent of a DSELECTK_DATA set in the caller's environment."""
    monkeypatch.delenv("DSELECTK_DATA", raising=False)
