"""The research commands of the ``dselectk`` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dselectk.cli import main
from dselectk_research.report import EXPERIMENTS


def test_unknown_experiments_are_rejected() -> None:
    with pytest.raises(SystemExit):
        main(["reproduce", "no-such-experiment"])


def test_every_experiment_is_a_reproduce_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["reproduce", "--help"])
    out = capsys.readouterr().out
    for name in EXPERIMENTS:
        assert name in out


def test_report_does_not_import_the_cli() -> None:
    code = (
        "import sys, dselectk_research.report as r; "
        "assert 'dselectk.cli' not in sys.modules; "
        "assert r.experiment_module('multi-fashion') == 'dselectk_research.multi_mnist'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
