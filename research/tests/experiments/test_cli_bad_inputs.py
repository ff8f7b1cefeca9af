"""Bad command-line input is refused up front, with one line naming the flag (exit code 2),
and summaries never mix runs made with different settings (issue: nothing silently wrong)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dselectk.cli import main

SYN = ["reproduce", "synthetic", "--no-progress", "--jobs", "1"]
REC = ["reproduce", "recovery", "--no-progress", "--jobs", "1"]
ML = ["reproduce", "movielens", "--no-progress"]
MM = ["reproduce", "multi-mnist", "--no-progress"]

BAD_FLAGS = [
    (REC, ["--reps", "-1"], "--reps"),
    (REC, ["--epochs", "-3"], "--epochs"),
    (REC, ["--lrs", "-0.1"], "--lrs"),
    (REC, ["--lrs", "nan"], "--lrs"),
    (REC, ["--jobs", "-1"], "--jobs"),
    (REC, ["--threads", "0"], "--threads"),
    (SYN, ["--reps", "-2"], "--reps"),
    (SYN, ["--n-train", "0"], "--n-train"),
    (SYN, ["--epochs", "-1"], "--epochs"),
    (SYN, ["--tasks", "7"], "--tasks"),
    (SYN, ["--tasks", "256"], "--tasks"),
    (SYN, ["--jobs", "-1"], "--jobs"),
    (SYN, ["--lr", "0"], "--lr"),
    (SYN, ["--lr", "inf"], "--lr"),
    (SYN, ["--gamma", "-1"], "--gamma"),
    (SYN, ["--entropy-reg", "-0.5"], "--entropy-reg"),
    (SYN, ["--max-points", "0"], "--max-points"),
    (ML, ["--alphas", "1.5"], "--alphas"),
    (ML, ["--reps", "0"], "--repetitions/--reps"),
    (ML, ["--neg-ratio", "0"], "--neg-ratio"),
    (ML, ["--lr", "-1"], "--lr"),
    (ML, ["--jobs", "-1"], "--jobs"),
    (MM, ["--n-train", "0"], "--n-train"),
    (MM, ["--epochs", "0"], "--epochs"),
    (MM, ["--grid-points", "0"], "--grid-points"),
]


@pytest.mark.parametrize(
    ("base", "flag", "name"), BAD_FLAGS, ids=[" ".join(f) for _, f, _ in BAD_FLAGS]
)
def test_bad_flag_values_exit_2_naming_the_flag(
    base: list[str], flag: list[str], name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main([*base, "--out", str(tmp_path / "out"), *flag])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {name}" in err.splitlines()[-1]
    assert not (tmp_path / "out").exists()  # refused before any work


@pytest.mark.parametrize("base", [SYN, REC], ids=["synthetic", "recovery"])
def test_out_that_is_a_file_fails_before_training(
    base: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert main([*base, "--out", str(f), "--reps", "1", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dselectk: error: --out") and "is a file" in err[0]


def test_report_of_a_folder_without_records_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no run records" in err[0]


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no run records"):
        main(["--debug", "report", str(tmp_path)])


def test_summaries_never_mix_settings(tmp_path: Path) -> None:
    """The same folder, 1 epoch then 2 epochs: the table summarises the last command only and
    names the other record (it used to average a 1-epoch and a 2-epoch run as n = 2)."""
    out = tmp_path / "rec"
    base = [*REC, "--out", str(out), "--reps", "1", "--lrs", "0.1", "--gates", "topk"]
    assert main([*base, "--epochs", "1"]) == 0
    assert main([*base, "--epochs", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["rows"]
    assert row["metrics"]["recovered"]["n"] == 1
    from dselectk_research.records import RunStore

    (planned,), others = RunStore(out).load_planned()
    assert planned["config"]["hparams"]["epochs"] == 2 and others == 1
    assert summary["records_not_summarised"] == 1
    assert "not summarised: 1" in (out / "report.md").read_text()
    assert len(list((out / "runs").glob("*.json"))) == 2  # both records are kept
    # rebuilding the report alone gives the same summary (plan.json names the runs)
    assert main(["report", str(out)]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["rows"] == summary["rows"]


def test_synthetic_repetitions_that_cannot_fit_are_refused_with_an_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s"
    assert main([*SYN, "--reps", "10000000", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--reps 10000000 × 32 experts" in err[0] and "GiB" in err[0]
    assert not out.exists()


def test_recovery_sizes_that_cannot_fit_are_refused_with_an_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    assert main([*REC, "--reps", "10000000", "--lrs", "0.1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--reps × --lrs (10000000 runs of a variant" in err[0]
    assert "GiB" in err[0] and not out.exists()


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                     "allocate memory: you tried to allocate 160000000000 bytes."),
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    ],
)  # fmt: skip
def test_out_of_memory_is_one_line_and_exit_2(
    error: BaseException,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dselectk_research.recovery import recipe

    def fail(*args: object, **kw: object) -> None:
        raise error

    monkeypatch.setattr(recipe, "run_recipe", fail)
    assert main([*REC, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dselectk: error: out of memory (")
    with pytest.raises(type(error)):  # --debug: the traceback
        main(["--debug", *REC, "--out", str(tmp_path / "r")])


def test_other_runtime_errors_are_not_disguised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dselectk_research.recovery import recipe

    def fail(*args: object, **kw: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(recipe, "run_recipe", fail)
    with pytest.raises(RuntimeError, match="a bug"):
        main([*REC, "--out", str(tmp_path / "r")])
