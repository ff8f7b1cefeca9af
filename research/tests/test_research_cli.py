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


def _help(capsys: pytest.CaptureFixture[str], *command: str) -> str:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("name", [*EXPERIMENTS, None])
def test_help_shows_defaults_one_way_and_the_slurm_flags_once(
    capsys: pytest.CaptureFixture[str], name: str | None
) -> None:
    text = _help(capsys, "reproduce", name) if name else _help(capsys, "report")
    flat = " ".join(text.split())
    assert "issue" not in flat.lower()
    for old in ("(default ", " default None", "(quick ", "(quick:"):
        assert old not in flat, old
    if name is None:
        return
    usage, _, body = flat.partition("options:")
    assert "--slurm" not in usage  # listed in their group only
    assert body.count("Slurm (with --executor slurm):") == 1
    assert body.count("--slurm-time MIN") == 1
    assert f"results folder (default: results/{name.replace('-', '_')}" in flat or (
        f"results folder (default: results/{name})" in flat
    )
    assert "--threads THREADS torch threads per process (default:" in flat


def test_renormalize_is_a_switch_and_keeps_its_value_spelling() -> None:
    from dselectk.cli import build_parser

    p = build_parser()
    base = ["reproduce", "token-moe", "--out", "x"]
    assert p.parse_args(base).renormalize is True  # the default: measured best per token
    assert p.parse_args([*base, "--renormalize"]).renormalize is True
    assert p.parse_args([*base, "--no-renormalize"]).renormalize is False
    assert p.parse_args([*base, "--renormalize", "true"]).renormalize is True
    assert p.parse_args([*base, "--renormalize", "False"]).renormalize is False
    for bad in (["--renormalize", "maybe"], ["--no-renormalize", "true"]):
        with pytest.raises(SystemExit):
            p.parse_args([*base, *bad])
