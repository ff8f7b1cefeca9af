"""The command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dselectk import cli
from dselectk.cli import main, source_root
from dselectk.experiments.report import EXPERIMENTS


def test_demo_runs_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["demo", "--tasks", "2", "--examples", "600", "--epochs", "1", "--no-progress"]) == 0
    )
    out = capsys.readouterr().out
    assert "selected experts" in out and "test  MSE" in out
    assert "observed: " in out and "same-group task pairs share an expert" in out


def test_unknown_arguments_are_rejected() -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--bogus"])
    with pytest.raises(SystemExit):
        main(["reproduce", "no-such-experiment"])


def test_bench_help_suite_runs_the_suite_from_the_checkout(tmp_path: Path) -> None:
    """`dselectk bench` runs `python -m benchmarks` in the checkout, from any working folder."""
    if source_root() is None:
        pytest.skip("not a source checkout (benchmarks/ absent)")
    out = subprocess.run(
        [sys.executable, "-m", "dselectk.cli", "bench", "--help-suite"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and "--quick" in out.stdout


def test_bench_without_checkout_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "source_root", lambda: None)
    assert main(["bench", "--quick"]) == 2
    assert "needs a source checkout" in capsys.readouterr().out


def test_report_does_not_import_the_cli() -> None:
    code = (
        "import sys, dselectk.experiments.report as r; "
        "assert 'dselectk.cli' not in sys.modules; "
        "assert r.experiment_module('multi-fashion') == 'dselectk.experiments.multi_mnist'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert cli.EXPERIMENTS is EXPERIMENTS
