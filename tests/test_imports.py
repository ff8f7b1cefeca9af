"""The core install (torch + numpy) imports without matplotlib and tqdm; the public API."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import dselectk

ROOT = Path(__file__).resolve().parents[1]
BLOCK = "import sys; sys.modules['matplotlib'] = None; sys.modules['tqdm'] = None; "

CORE_MODULES = [
    "dselectk",
    "dselectk.gates",
    "dselectk.layers",
    "dselectk.models",
    "dselectk.functional",
    "dselectk.training",
    "dselectk.io",
    "dselectk.progress",
]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_core_imports_without_matplotlib_and_tqdm() -> None:
    out = _python(BLOCK + "import " + ", ".join(CORE_MODULES) + "; print('ok')")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_all_names_are_importable() -> None:
    for name in dselectk.__all__:
        assert getattr(dselectk, name) is not None, name
    out = _python(f"from dselectk import {', '.join(dselectk.__all__)}")
    assert out.returncode == 0, out.stderr


def test_readme_first_python_example_runs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"```python\n(.*?)```", readme, flags=re.S)
    if match is None:
        pytest.fail("README.md has no ```python block")
    out = _python(match.group(1))
    assert out.returncode == 0, f"README example failed:\n{match.group(1)}\n{out.stderr}"
