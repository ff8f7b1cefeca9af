"""The command line."""

from __future__ import annotations

import pytest

from dselectk.cli import main


def test_demo_runs_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["demo", "--tasks", "2", "--examples", "600", "--epochs", "1", "--no-progress"]) == 0
    )
    out = capsys.readouterr().out
    assert "selected experts" in out and "test  MSE" in out


def test_unknown_arguments_are_rejected() -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--bogus"])
    with pytest.raises(SystemExit):
        main(["reproduce", "no-such-experiment"])
