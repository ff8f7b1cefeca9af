"""Issue 24, round two: diverged runs stay visible (tables, summaries, exit codes), the wall time
of a resumed sweep accumulates, and a MovieLens ``--neg-ratio`` that cannot fit is refused."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from dselectk.cli import main
from dselectk_research import movielens as ml
from dselectk_research import records
from dselectk_research.records import RunStore, summarize
from dselectk_research.templates import wall_line

SYNTH = ["reproduce", "synthetic", "--tasks", "16", "--gates", "topk", "--reps", "2"]
SYNTH += ["--epochs", "2", "--n-train", "300", "--n-eval", "300", "--threads", "1"]


def test_synthetic_diverged_runs_are_counted_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s"
    assert main([*SYNTH, "--lr", "1e30", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "topk/16 (2 of 2)" in captured.err and "diverged" in captured.err
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["rows"]
    assert row["runs"] == 2 and row["diverged"] == 2 and row["metrics"]["test_mse"]["n"] == 0
    assert summary["diverged"] == 2
    report = (out / "report.md").read_text()
    assert "**2 of them diverged**" in report and "| diverged |" in report
    assert "diverged" in captured.out  # the printed table has the column
    # the records say so, and a rebuild from them alone keeps the count
    assert all(r.get("diverged") for r in RunStore(out).load())
    capsys.readouterr()
    assert main(["report", str(out)]) == 1  # the rebuild says so too, in one line
    assert "2 run(s) of this folder diverged" in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["rows"][0]["diverged"] == 2


def test_recovery_diverged_lr_is_recorded_skipped_and_reruns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    argv = ["reproduce", "recovery", "--out", str(out), "--gates", "topk", "--reps", "1"]
    argv += ["--epochs", "2", "--lrs", "1e38", "1e-2"]
    assert main(argv) == 1  # was KeyError: 'val_loss'
    assert "topk lr=1e+38 (1 of 1)" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert [r["lr"] for r in summary["selected"]] == [0.01]
    assert summary["skipped_lrs"] == {"topk": [1e38]}
    assert "Learning rates skipped by the selection" in (out / "report.md").read_text()
    # records written before the fix (no flag, val_loss null) neither crash a rebuild nor a rerun
    for p in (out / "runs").glob("*.json"):
        rec = json.loads(p.read_text())
        rec.pop("diverged", None)
        p.write_text(json.dumps(rec))
    assert main(["report", str(out)]) == 1  # rebuilt (no crash); exit 1 as the sweep's
    assert main(argv) == 1
    assert json.loads((out / "summary.json").read_text())["diverged"] == 1


def test_summarize_counts_diverged_and_leaves_them_out_of_means() -> None:
    recs = [
        {"config": {"g": "a"}, "metrics": {"loss": 1.0, "acc": 0.5}},
        {"config": {"g": "a"}, "metrics": {"loss": None, "acc": 0.9}},
        {"config": {"g": "a"}, "metrics": {"loss": 3.0, "acc": 0.7}, "diverged": True},
    ]
    (row,) = summarize(recs, ["g"], finite=["loss"])
    assert row["runs"] == 3 and row["diverged"] == 2
    assert row["metrics"]["acc"]["n"] == 1 and row["metrics"]["acc"]["mean"] == 0.5
    (plain,) = summarize(recs, ["g"])  # without ``finite``: as before
    assert "diverged" not in plain and plain["metrics"]["acc"]["n"] == 3


def test_wall_time_accumulates_over_a_resumed_plan(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.write_plan(["a", "b"], "cmd")
    first = records.wall_time(tmp_path, {}, 421.0, "cmd")
    assert first["seconds"] == 421.0 and len(first["commands"]) == 1
    resumed = records.wall_time(tmp_path, {"wall_time": first}, 2.0, "cmd")
    assert resumed["seconds"] == pytest.approx(423.0) and len(resumed["commands"]) == 2
    assert "423 s, summed over the 2 commands" in wall_line({"wall_time": resumed})
    # a rebuild (no time of its own) keeps it; a Slurm re-attach adds ~0, never writes 0
    assert records.wall_time(tmp_path, {"wall_time": resumed}, None, None)["seconds"] == 423.0
    assert records.wall_time(tmp_path, {"wall_time": resumed}, 0.0, "cmd")["seconds"] == 423.0
    # a summary of an earlier version (wall_seconds only, no plan digest) is not continued:
    # this command's time starts a new total
    old = records.wall_time(tmp_path, {"wall_seconds": 421.0, "command": "cmd"}, 2.0, "cmd")
    assert old["seconds"] == pytest.approx(2.0) and len(old["commands"]) == 1
    # another plan starts a new total and says how many runs earlier commands recorded
    (tmp_path / "runs").mkdir()
    rec = tmp_path / "runs" / "a.json"
    rec.write_text("{}")
    past = time.time() - 1000
    os.utime(rec, (past, past))
    store.write_plan(["a", "c"], "cmd2")
    other = records.wall_time(tmp_path, {"wall_time": resumed}, 5.0, "cmd2", [{"run_id": "a"}])
    assert other["seconds"] == 5.0 and other["runs_untimed"] == 1
    assert "1 of 2 runs were recorded by earlier commands" in wall_line({"wall_time": other}, 2)


def test_synthetic_resume_keeps_the_first_commands_wall_time(tmp_path: Path) -> None:
    out = tmp_path / "w"
    argv = [*SYNTH, "--lr", "1e-3", "--epochs", "1", "--out", str(out)]
    assert main(argv) == 0
    first = json.loads((out / "summary.json").read_text())["wall_seconds"]
    assert main(argv) == 0  # everything done: a resume that trains nothing
    summary = json.loads((out / "summary.json").read_text())
    assert summary["wall_seconds"] >= first > 0
    assert len(summary["wall_time"]["commands"]) == 2
    assert "summed over the 2 commands" in (out / "report.md").read_text()


def test_recovery_resume_keeps_the_first_commands_wall_time(tmp_path: Path) -> None:
    out = tmp_path / "rw"
    argv = ["reproduce", "recovery", "--out", str(out), "--gates", "topk", "--reps", "1"]
    argv += ["--epochs", "1", "--lrs", "1e-2"]
    assert main(argv) == 0
    first = json.loads((out / "summary.json").read_text())["wall_seconds"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["wall_seconds"] >= first > 0 and len(summary["wall_time"]["commands"]) == 2


def test_movielens_neg_ratio_beyond_memory_is_refused_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(*a: object, **k: object) -> None:
        raise AssertionError("the data must not be loaded")

    monkeypatch.setattr(ml, "load_data", no_load)
    monkeypatch.setattr(ml, "physical_memory", lambda: 16 * 2**30)
    argv = ["reproduce", "movielens", "--out", str(tmp_path / "m"), "--neg-ratio", "1000"]
    assert main([*argv, "--data-dir", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--neg-ratio 1000" in err and "GiB" in err
    cfg = ml.MovieLensConfig(out=tmp_path, gates=("topk",), variant="ml-1m", neg_ratio=1)
    ml.check_memory(cfg, total=16 * 2**30)  # the paper's setting fits
    assert ml.data_bytes("ml-1m", 1000) > 100 * ml.data_bytes("ml-1m", 1)


def test_synthetic_grid_search_skips_diverged_configurations(tmp_path: Path) -> None:
    from dselectk_research.data.synthetic import generate_data
    from dselectk_research.synthetic.train import tune

    data = generate_data(0, 300, 300, 300)
    grid: dict[str, list[float]] = {"lr": [1e30, 1e-3], "epochs": [2]}
    cfg = {"seed": 0, "n_train": 300, "n_eval": 300}
    store = RunStore(tmp_path)
    choice = tune("topk", 16, data, store, grid=grid, trials=1, data_cfg=cfg, progress=False)
    assert choice["hparams"]["lr"] == 1e-3 and choice["configs_diverged"] == 1
