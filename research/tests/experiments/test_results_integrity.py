"""Nothing silently wrong in a results folder: exploded runs are diverged runs (every table,
summary and exit code, ``dselectk report`` included), a folder the package did not make is
refused before anything is written, earlier reports are kept, summary and report never
disagree, and flags that would have no effect are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from dselectk.cli import main
from dselectk_research.records import (
    EXPLOSION_FACTOR,
    SCHEMA_VERSION,
    RunStore,
    diverged,
    run_id,
    summarize,
)
from dselectk_research.runner import report_pair
from dselectk_research.selection import report as selection_report
from dselectk_research.synthetic.report import FINITE as SYNTHETIC_FINITE

REC = ["reproduce", "recovery", "--no-progress", "--reps", "1", "--epochs", "1", "--jobs", "1"]
REC += ["--gates", "topk"]


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# -- divergence: non-finite or exploded ---------------------------------------------------------
def test_a_loss_far_above_its_bound_is_diverged() -> None:
    bound = {"loss": 10.0}
    assert diverged({"metrics": {"loss": 7.9e13}}, bound)
    assert diverged({"metrics": {"loss": 10.0 + 1e-9}}, bound)
    assert not diverged({"metrics": {"loss": 10.0}}, bound)
    assert not diverged({"metrics": {"loss": 7.9e13}}, ["loss"])  # finiteness only, as named
    assert diverged({"metrics": {"loss": None}}, bound)
    assert diverged({"metrics": {}}, bound)
    # the synthetic bound: EXPLOSION_FACTOR times the MSE of predicting 0 (~40 on its data)
    assert SYNTHETIC_FINITE["test_mse"] == EXPLOSION_FACTOR * 40.3
    recs = [
        {"config": {"g": "a"}, "metrics": {"loss": 1.0}},
        {"config": {"g": "a"}, "metrics": {"loss": 3.0}},
        {"config": {"g": "a"}, "metrics": {"loss": 7.9e13}},
    ]
    (row,) = summarize(recs, ["g"], finite=bound)
    assert row["runs"] == 3 and row["diverged"] == 1
    assert row["metrics"]["loss"] == {"mean": 2.0, "se": 1.0, "n": 2}


def _synthetic_record(rep: int, mse: float) -> dict[str, Any]:
    config = {
        "experiment": "synthetic",
        "phase": "final",
        "gate": "topk",
        "variant": {"gate": "topk"},
        "num_tasks": 16,
        "num_experts": 4,
        "k": 4,
        "rep": rep,
        "init_seed": rep,
        "shuffle_seed": 0,
        "batch_size": 256,
        "hparams": {"lr": 1e6, "epochs": 2},
        "data": {"seed": 0, "n_train": 2000, "n_eval": 500},
    }
    metrics = {"test_mse": mse, "val_mse": mse, "related_jaccard": 1.0, "unrelated_jaccard": None}
    metrics |= {"experts_per_task": 4.0, "frac_tasks_k_experts": 1.0}
    return {"run_id": run_id(config), "config": config, "metrics": metrics}


def test_report_of_a_folder_with_exploded_runs_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--lr 1e6`` finishes at a test MSE of 7.9e13 without a NaN: it is a diverged run."""
    runs = tmp_path / "runs"
    runs.mkdir()
    for rec in (_synthetic_record(0, 13.5), _synthetic_record(1, 7.9e13)):
        (runs / f"{rec['run_id']}.json").write_text(json.dumps(rec))
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 1
    assert "1 run(s) of this folder diverged" in _one_line(capsys)
    summary = json.loads((tmp_path / "summary.json").read_text())
    (row,) = summary["rows"]
    assert summary["diverged"] == 1 and row["diverged"] == 1 and row["runs"] == 2
    assert row["metrics"]["test_mse"]["mean"] == 13.5  # the explosion is not averaged
    assert "**1 of them diverged**" in (tmp_path / "report.md").read_text()


def _selection_test(arm: str, rep: int, recovered: float, loss: float) -> dict[str, Any]:
    shape = {"experts": 16, "true": 4, "k": 4}
    config = {
        "experiment": "selection",
        "phase": "test",
        "arm": arm,
        "shape": shape,
        "lr": 0.01,
        "rep": rep,
        "data": {"seed": 1, "n_test": 10},
    }
    metrics = {"recovered": recovered, "test_loss": loss, "probe_passes": 0.0}
    metrics |= {"probe_share": 0.0, "all_recovered": 0.0, "binary": 1.0}
    return {"run_id": run_id(config), "config": config, "metrics": metrics}


def test_selection_never_pairs_or_averages_an_exploded_run() -> None:
    recs = [
        _selection_test("topk", 0, 1.0, 0.5),
        _selection_test("topk", 1, 1.0, 0.5),
        _selection_test("dselect_k_search", 0, 4.0, 0.3),
        _selection_test("dselect_k_search", 1, 0.0, 1e29),  # exploded at --lrs 1e30
    ]
    summary = selection_report._summary(recs)
    (setting,) = summary["shapes"].values()
    rows = {r["arm"]: r for r in setting["rows"]}
    assert rows["dselect_k_search"]["diverged"] == 1 and rows["dselect_k_search"]["runs"] == 2
    assert rows["dselect_k_search"]["metrics"]["test_loss"]["mean"] == 0.3
    pair = next(p for p in setting["paired"] if p["arm"] == "dselect_k_search")
    assert pair["n"] == 1 and (pair["win"], pair["tie"], pair["loss"]) == (1, 0, 0)
    assert summary["diverged"] == 1
    line = selection_report.diverged_line(summary)
    assert line is not None and "dselect_k_search 16/4 lr=0.01 rep 1" in line


# -- results folders -----------------------------------------------------------------------------
def test_a_folder_with_user_files_is_refused_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "work"
    mine.mkdir()
    (mine / "report.md").write_text("my own report")
    (mine / "summary.json").write_text('{"mine": 1}')
    before = sorted(p.name for p in mine.iterdir())
    capsys.readouterr()
    assert main([*REC, "--lrs", "0.1", "--out", str(mine)]) == 2
    assert "not a results folder" in _one_line(capsys)
    assert sorted(p.name for p in mine.iterdir()) == before  # not even a lock file
    assert (mine / "report.md").read_text() == "my own report"


def test_the_runs_folder_of_a_results_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = tmp_path / "A"
    (a / "runs").mkdir(parents=True)
    (a / "summary.json").write_text("{}")
    capsys.readouterr()
    assert main([*REC, "--lrs", "0.1", "--out", str(a / "runs")]) == 2
    assert "the runs/ folder of the results folder" in _one_line(capsys)
    assert sorted(p.name for p in (a / "runs").iterdir()) == []


def test_a_foreign_runs_folder_is_refused_before_any_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "events.out.tfevents").write_text("not ours")
    capsys.readouterr()
    assert main([*REC, "--lrs", "0.1", "--out", str(tmp_path)]) == 2
    assert "is not a run record" in _one_line(capsys)
    assert not (tmp_path / "sweep.json").exists()  # refused before the sweep began
    (tmp_path / "runs" / "events.out.tfevents").unlink()
    (tmp_path / "runs" / ("0" * 16 + ".json")).write_text("[1, 2]")
    assert main([*REC, "--lrs", "0.1", "--out", str(tmp_path)]) == 2
    assert "not a valid run record" in _one_line(capsys)
    assert not (tmp_path / "sweep.json").exists()


def test_a_rerun_with_other_settings_keeps_the_earlier_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "r"

    def run(*argv: str) -> int:
        monkeypatch.setattr(sys, "argv", ["dselectk", *argv])  # the command a report names
        return main(list(argv))

    assert run(*REC, "--lrs", "0.1", "--out", str(out)) == 0
    first = (out / "report.md").read_text()
    assert run(*REC, "--lrs", "0.03", "--out", str(out)) == 0
    kept = out / "previous" / "1"
    assert (kept / "report.md").read_text() == first
    assert "--lrs 0.1 --out" in json.loads((kept / "plan.json").read_text())["command"]
    summary = json.loads((out / "summary.json").read_text())
    assert [e["report"] for e in summary["earlier_commands"]] == ["previous/1/report.md"]
    report = (out / "report.md").read_text()
    assert "## Earlier commands in this folder" in report and "--lrs 0.1 --out" in report
    # the same command again (a rerun of finished runs) keeps no copy, a rebuild keeps the list
    assert run(*REC, "--lrs", "0.03", "--out", str(out)) == 0
    assert sorted(p.name for p in (out / "previous").iterdir()) == ["1"]
    assert run("report", str(out)) == 0
    assert "--lrs 0.1 --out" in (out / "report.md").read_text()
    capsys.readouterr()
    # telemetry asked for on a rerun of finished runs would be credited but not applied
    assert run(*REC, "--lrs", "0.1", "--telemetry", "--out", str(out)) == 2
    assert "--telemetry True: applies only to runs this command trains" in _one_line(capsys)
    assert run(*REC, "--lrs", "0.1", "--record-every", "3", "--out", str(out)) == 2
    assert "--record-every 3" in _one_line(capsys)
    assert not (out / "telemetry").exists()
    # into a fresh folder they are applied
    fresh = tmp_path / "fresh"
    assert run(*REC, "--lrs", "0.1", "--telemetry", "--out", str(fresh)) == 0
    assert (fresh / "telemetry").is_dir()


def test_summary_and_report_are_restored_together_on_failure(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text('{"v": 1}')
    (tmp_path / "report.md").write_text("v1")
    with pytest.raises(OSError, match="No space"), report_pair(tmp_path):
        (tmp_path / "summary.json").write_text('{"v": 2}')  # written, then the report fails
        raise OSError(28, "No space left on device")
    assert (tmp_path / "summary.json").read_text() == '{"v": 1}'
    assert (tmp_path / "report.md").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "summary.json"]
    new = tmp_path / "new"
    new.mkdir()
    with pytest.raises(RuntimeError), report_pair(new):
        (new / "summary.json").write_text("{}")
        raise RuntimeError("report failed")
    assert list(new.iterdir()) == []  # no summary without its report
    with report_pair(tmp_path):
        (tmp_path / "summary.json").write_text('{"v": 3}')
        (tmp_path / "report.md").write_text("v3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "report.md", "summary.json"]
    assert (tmp_path / "report.md").read_text() == "v3"


# -- flags that would be credited but not applied -----------------------------------------------
@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["reproduce", "synthetic", "--trials", "3"], "--trials 3: applies only with --full"),
        (["reproduce", "synthetic", "--max-points", "2"], "applies only with --full"),
        (["reproduce", "movielens", "--grid-points", "4"], "applies only with --full"),
        ([*REC, "--slurm-time", "5"], "--slurm-time: Slurm flags apply only with --executor slurm"),
        ([*REC, "--slurm-partition", "gpu"], "--slurm-partition"),
        (["reproduce", "synthetic", "--seed", "1e20"], "expected an integer seed"),
        (["reproduce", "recovery", "--seed", str(2**32)], "larger seeds would alias"),
        (["reproduce", "recovery", "--data-seed", "-1"], "expected an integer seed"),
        (["reproduce", "token-moe", "--first-seed", str(2**31 - 1), "--seeds", "2"], "alias"),
    ],
)
def test_flags_without_effect_or_aliasing_seeds_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    out = tmp_path / "o"
    assert _exit_code([*argv, "--out", str(out)]) == 2
    assert words in capsys.readouterr().err
    assert not out.exists()  # refused before the folder was made


def _exit_code(argv: list[str]) -> int:
    """``dselectk ARGV``'s exit code (argparse's errors exit through SystemExit)."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def test_every_record_carries_the_schema_version(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    path = store.save({"experiment": "x", "rep": 0}, {"loss": 1.0})
    rec = json.loads(path.read_text())
    assert rec["schema"] == SCHEMA_VERSION == 2
    assert rec["run_id"] == run_id({"experiment": "x", "rep": 0})  # the stamp is not identity
