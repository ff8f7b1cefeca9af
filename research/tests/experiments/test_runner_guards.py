"""The shared runner keeps good results: a folder in use is refused, an empty --out is refused,
and a report is never rebuilt from nothing."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from dselectk.cli import main
from dselectk_research.runner import LOCK_FILE, folder_lock

REC = ["reproduce", "recovery", "--no-progress", "--reps", "1", "--lrs", "0.1", "--epochs", "1"]


def _hold_lock(out: str, ready: mp.synchronize.Event, release: mp.synchronize.Event) -> None:
    with folder_lock(Path(out)):
        ready.set()
        release.wait(30)


def test_a_second_command_in_a_folder_in_use_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        assert main([*REC, "--gates", "topk", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "another dselectk command is running there" in err[0]
        assert f"pid {holder.pid}" in err[0]
        assert not (tmp_path / "runs").exists()  # nothing was trained or written
    finally:
        release.set()
        holder.join(30)
    # the lock dies with its holder: the same command now runs
    assert main([*REC, "--gates", "topk", "--out", str(tmp_path)]) == 0
    assert (tmp_path / LOCK_FILE).is_file()


@pytest.mark.parametrize(
    "study", ["synthetic", "recovery", "token-moe", "movielens", "multi-mnist"]
)
def test_empty_out_is_refused(
    study: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["reproduce", study, "--out", ""])
    assert e.value.code == 2
    assert "--out: expected a results folder, got an empty path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_report_without_records_keeps_the_last_summary_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rec"
    assert main([*REC, "--gates", "topk", "--out", str(out)]) == 0
    summary, report = (out / "summary.json").read_text(), (out / "report.md").read_text()
    assert json.loads(summary)["rows"]
    for p in (out / "runs").glob("*.json"):
        p.unlink()
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no run records" in err[0] and "left as they are" in err[0]
    assert (out / "summary.json").read_text() == summary
    assert (out / "report.md").read_text() == report


def test_ctrl_c_is_one_line_and_keeps_finished_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dselectk_research.recovery import recipe as rec

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(rec, "train_reps", interrupted)
    assert main([*REC, "--gates", "topk", "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted" in err[0] and "run the same command" in err[0]
    with pytest.raises(KeyboardInterrupt):  # --debug shows the traceback
        main(["--debug", *REC, "--gates", "topk", "--out", str(tmp_path)])


def test_core_install_writes_the_report_without_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without matplotlib (the core install) a study and `dselectk report` still finish: the
    report is written without plots, and one line says how to get them."""
    from dselectk_research.plots import _mpl

    def missing() -> None:
        raise ImportError(_mpl.MISSING)

    monkeypatch.setattr(_mpl, "pyplot", missing)
    monkeypatch.setattr(_mpl, "_NOTED", [])
    out = tmp_path / "rec"
    assert main([*REC, "--gates", "topk", "--out", str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dselectk: plots skipped: {_mpl.MISSING}"]
    assert (out / "report.md").is_file() and not list(out.rglob("*.png"))
    assert main(["report", str(out)]) == 0


@pytest.mark.parametrize(
    ("study", "args"),
    [
        ("token-moe", ["--steps", "30", "--no-progress"]),
        ("selection", ["--no-progress"]),
        ("synthetic", ["--tasks", "16", "--no-progress"]),
    ],
)
def test_another_experiments_folder_is_refused_before_any_work(
    study: str, args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rec"
    assert main([*REC, "--gates", "topk", "--out", str(out)]) == 0
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["reproduce", study, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds records of another experiment (recovery)" in err[0]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files  # untouched
    assert main(["report", str(out)]) == 0  # still a recovery folder


def test_the_same_experiment_resumes_in_its_folder(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    assert main([*REC, "--gates", "topk", "--out", str(out)]) == 0
    assert main([*REC, "--gates", "topk", "dselect_k", "--out", str(out)]) == 0


def test_the_folder_guard_reads_past_unreadable_records(tmp_path: Path) -> None:
    """A garbled record or a folder where a record belongs is the sweep's to report (it names
    the file, or a Slurm job fails on it), not a reason for the guard to refuse."""
    from dselectk_research.runner import _check_same_experiment

    runs = tmp_path / "runs"
    (runs / "a.json").mkdir(parents=True)
    (runs / "b.json").write_text("{garbled")
    (runs / "c.json").write_text("[1, 2]")
    _check_same_experiment(tmp_path, "recovery")  # nothing readable: no refusal
    (runs / "d.json").write_text(json.dumps({"config": {"experiment": "recovery"}}))
    _check_same_experiment(tmp_path, "synthetic")  # no metrics: not a record, the sweep's to name
    (runs / "d.json").write_text(json.dumps({"config": {"experiment": "recovery"}, "metrics": {}}))
    _check_same_experiment(tmp_path, "recovery")
    with pytest.raises(ValueError, match=r"another experiment \(recovery\)"):
        _check_same_experiment(tmp_path, "synthetic")
