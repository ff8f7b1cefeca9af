"""The benchmark package (``benchmarks/``) stays importable and its memory child runs.

No timings are checked here; the suite itself runs with ``python -m benchmarks [--quick]``.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks`` is a top-level folder of the checkout, not an installed package."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))


def test_registry_modules_import_and_define_run() -> None:
    suite = importlib.import_module("benchmarks.suite")
    assert tuple(suite.REGISTRY) == suite.ITEMS
    assert set(suite.ITEMS) == {
        "gate", "bank", "mmoe", "conditional", "memory", "scaling", "synthetic"
    }  # fmt: skip
    for item, module in suite.REGISTRY.items():
        mod = importlib.import_module(module)
        assert callable(getattr(mod, "run", None)), item
    assert callable(suite.main)


def test_cli_options_parse() -> None:
    suite = importlib.import_module("benchmarks.suite")
    args = suite.build_parser().parse_args(["--quick", "--only", "gate", "memory"])
    assert args.quick and args.only == ["gate", "memory"] and args.device == "cpu"


def _child_cli(kind: str) -> dict[str, float]:
    """``python -m benchmarks.memory_child KIND cpu`` on a tiny gate, from the repository root."""
    sizes = ["--batch=8", "--features=4", "--experts=8", "--k=2"]
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory_child", kind, "cpu", *sizes],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_memory_child_runs_as_module() -> None:
    """The child as a command and through the memory item's helper (both at once: 2 cores)."""
    memory = importlib.import_module("benchmarks.memory")
    with ThreadPoolExecutor(2) as pool:
        cli = pool.submit(_child_cli, "ours")
        item = pool.submit(memory.mem_child, "naive", torch.device("cpu"), batch=8, experts=8, k=2)
        outs = [cli.result(), item.result()]
    for out in outs:
        assert "error" not in out, out
        assert {"rss_before_mb", "rss_peak_mb", "rss_growth_mb"} <= set(out)
        assert out["rss_peak_mb"] > 0 and out["rss_growth_mb"] >= 0


@pytest.mark.slow
def test_quick_suite_single_item(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "memory", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    assert "== memory:" in res.stdout
    (path,) = tmp_path.glob("bench-cpu-quick-*.json")
    assert "memory" in json.loads(path.read_text())["items"]
