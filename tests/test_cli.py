"""The command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dselectk import cli
from dselectk.cli import main, source_root


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


@pytest.mark.parametrize("command", ["reproduce", "report"])
def test_research_commands_without_the_research_part_say_how_to_install(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    assert main([command, "synthetic", "--reps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"`dselectk {command}`" in err and "pip install -e research" in err


def test_commands_of_installed_add_ons_are_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class EntryPoint:
        name = "extra"

        def load(self):  # type: ignore[no-untyped-def]
            def register(sub):  # type: ignore[no-untyped-def]
                p = sub.add_parser("hello")
                p.add_argument("--times", type=int, default=1)
                p.set_defaults(handler=lambda args: calls.append("hello") or args.times)

            return register

    monkeypatch.setattr(cli, "entry_points", lambda group: [EntryPoint()])
    assert main(["hello", "--times", "3"]) == 3
    assert calls == ["hello"]


def test_demo_help_names_every_flag_and_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--tasks", 8), ("--examples", 12000), ("--epochs", 100), ("--seed", 0)):
        metavar = flag[2:].upper()
        after = flat.split(f"{flag} {metavar} ", 1)[1]
        assert not after.startswith("(default")  # a help text comes first
        assert f"(default: {default})" in after.split(" --", 1)[0]
    assert "training epochs (default: 100)" in flat
