"""Issue 24, round two, the left-overs: a bad-input test per class.

* real-data runs that diverge are recorded, counted in every table, the summary and the exit
  code (``reproduce movielens`` / ``multi-mnist``), never a traceback;
* a report made before its sweep finished (Slurm jobs still running, an interrupted command)
  says it is partial and how many planned runs are recorded;
* ``--tuned`` files: refused when malformed or missing cells (one line naming the file and the
  cells), credited by content digest; the run identity follows the content, not the name;
* every flag's bad value is refused by its argparse type (exit code 2, one line naming it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_realdata import write_ml100k, write_mnist

from dselectk.cli import main
from dselectk_research import records as records_mod
from dselectk_research.records import RunStore

SYN = ["reproduce", "synthetic", "--tasks", "16", "--gates", "topk", "--reps", "1"]
SYN += ["--epochs", "1", "--n-train", "256", "--n-eval", "256", "--threads", "1", "--no-progress"]
REC = ["reproduce", "recovery", "--gates", "topk", "--reps", "1", "--epochs", "1", "--lrs", "1e-2"]
REC += ["--no-progress"]

_UNVERIFIED = pytest.mark.filterwarnings("ignore:checksum verification:UserWarning")


@pytest.fixture
def tiny_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSELECTK_VERIFY", "0")


def _summary(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "summary.json").read_text()))


# -- real-data divergence ----------------------------------------------------------------------
@_UNVERIFIED
@pytest.mark.usefixtures("tiny_files")
def test_movielens_diverged_runs_are_recorded_counted_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_ml100k(tmp_path / "data")
    out = tmp_path / "ml"
    argv = ["reproduce", "movielens", "--variant", "ml-100k", "--data-dir", str(tmp_path / "data")]
    argv += ["--out", str(out), "--alphas", "0.5", "--gates", "topk_static", "--epochs", "1"]
    argv += ["--repetitions", "2", "--no-progress", "--lr", "1e30"]
    assert main(argv) == 1  # was a TrainingDivergedError traceback, nothing saved
    err = capsys.readouterr().err
    assert "topk_static/alpha=0.5 (2 of 2)" in err and "Traceback" not in err
    summary = _summary(out)
    assert summary["diverged"] == 2
    (row,) = summary["rows"]
    assert row["runs"] == 2 and row["diverged"] == 2 and row["metrics"]["test_loss"]["n"] == 0
    report = (out / "report.md").read_text()
    assert "**2 of them diverged**" in report
    # every table names them beside the gate: Table 1, Table C.3
    assert report.count("Static Top-k (**2 of 2 runs diverged**)") == 2
    recs = RunStore(out).load()
    assert len(recs) == 2 and all(r["diverged"] and r["diverged_error"] for r in recs)
    # the rebuild from the records alone keeps the counts (and exits 1 as the sweep did); a
    # rerun trains nothing and exits 1
    assert main(["report", str(out)]) == 1
    assert _summary(out)["diverged"] == 2
    assert main(argv) == 1
    assert len(RunStore(out).load()) == 2


@_UNVERIFIED
@pytest.mark.usefixtures("tiny_files")
def test_multi_mnist_diverged_runs_in_table_and_throughput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_mnist(tmp_path / "data", "mnist")
    out = tmp_path / "mm"
    argv = ["reproduce", "multi-mnist", "--data-dir", str(tmp_path / "data"), "--out", str(out)]
    argv += ["--gates", "softmax", "--epochs", "1", "--n-train", "64", "--n-val", "32"]
    argv += ["--n-test", "32", "--no-progress", "--lr", "1e30"]
    assert main(argv) == 1
    assert "softmax (1 of 1)" in capsys.readouterr().err
    report = (out / "report.md").read_text()
    assert report.count("Softmax MoE (**1 of 1 runs diverged**)") == 2  # Table 2, throughput
    assert _summary(out)["rows"][0]["diverged"] == 1


def test_realdata_grid_search_never_selects_a_point_with_a_diverged_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import math
    from types import SimpleNamespace

    from dselectk_research import movielens as ml
    from dselectk_research.realdata import train as rd_train

    exp = ml.experiment()
    calls: list[float] = []

    def fake_train_one(exp_: Any, gate: str, hp: Any, *a: Any, **k: Any) -> Any:
        calls.append(hp["lr"])
        if hp["lr"] == 0.3 and len(calls) % 2 == 0:  # one trial of lr 0.3 diverges
            return rd_train.diverged_metrics(FloatingPointError("boom"), 0.0, 2)
        return {"val_loss": 1.0 if hp["lr"] == 0.3 else 2.0}, {}

    monkeypatch.setattr(rd_train, "train_one", fake_train_one)
    args = SimpleNamespace(seed=0, epochs=1, lr=None, grid_points=100, trials=2)
    data = SimpleNamespace(config={"x": 1})
    monkeypatch.setitem(exp.grid, "softmax", {"lr": [0.3, 0.1], "epochs": [1]})  # type: ignore[index]
    choice = rd_train.tune(exp, args, "softmax", 0.5, data, RunStore(tmp_path), False)  # type: ignore[arg-type]
    assert choice["hparams"]["lr"] == 0.1 and math.isfinite(choice["val_metric"])
    tune_recs = RunStore(tmp_path).load()
    assert sum(1 for r in tune_recs if r.get("diverged")) == 1


# -- partial reports ---------------------------------------------------------------------------
def test_report_of_an_interrupted_sweep_says_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s"
    argv = [*SYN[:5], "topk", "dselect_k", "--reps", "3", "--batch-reps", "1", *SYN[8:]]
    argv += ["--out", str(out)]
    save = RunStore.save
    calls = {"n": 0}

    def interrupted_save(self: RunStore, *a: Any, **k: Any) -> Path:
        calls["n"] += 1
        if calls["n"] == 5:  # the first cell (3 runs) finished, the second one is cut short
            raise KeyboardInterrupt
        return save(self, *a, **k)

    monkeypatch.setattr(RunStore, "save", interrupted_save)
    assert main(argv) == 130
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    err = capsys.readouterr().err
    assert "PARTIAL" in err and "4 of 6 planned final runs recorded" in err
    assert "1 of 2 cells finished" in err
    report = (out / "report.md").read_text()
    assert report.splitlines()[2].startswith("> **PARTIAL") and "4 of 6" in report
    partial = _summary(out)["partial"]
    assert partial["recorded"] == 4 and partial["planned_runs"] == 6
    # the same command again finishes the sweep: the report is whole again
    monkeypatch.setattr(RunStore, "save", save)
    assert main(argv) == 0
    assert "PARTIAL" not in (out / "report.md").read_text()
    assert "partial" not in _summary(out)
    assert main(["report", str(out)]) == 0
    assert "PARTIAL" not in (out / "report.md").read_text()


def test_partial_sweep_state_counts_only_this_sweeps_runs(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    old = store.save({"phase": "final", "i": 0}, {"x": 1.0})
    import os

    os.utime(old, (1.0, 1.0))  # written long before the sweep started
    store.begin_sweep("cmd", ["a", "b", "c"], 4)
    new = store.save({"phase": "final", "i": 1}, {"x": 1.0})
    tune = store.save({"phase": "tune", "i": 2}, {"x": 1.0})
    status = store.sweep_status()
    assert status is not None and status["recorded"] == 1 and status["planned_runs"] == 4
    assert status["cells_missing"] == ["a", "b", "c"]
    store.sweep_cell_done("a", [old.stem])  # a cell that reused an earlier record
    status = store.sweep_status()
    assert status is not None and status["recorded"] == 2 and status["cells_done"] == 1
    planned, others = store.load_planned()
    assert {r["run_id"] for r in planned} == {old.stem, new.stem, tune.stem}
    assert others == 0
    line = records_mod.partial_line(status)
    assert "2 of 4 planned final runs recorded" in line and "missing b, c" in line
    store.end_sweep()
    assert store.sweep_status() is None
    (tmp_path / records_mod.SWEEP_FILE).write_text("{garbled")
    with pytest.raises(ValueError, match="not a valid sweep state"):
        store.sweep_status()


# -- --tuned files -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{oops", ["not valid JSON"]),
        ("[1, 2]", ["expected a JSON object"]),
        ('{"hparams": [1]}', ["'hparams' must map"]),
        ('{"hparams": {"topk": {"default": 3}}}', ["'hparams' must map"]),
        ('{"hparams": {"dselect_k": {"default": {"lr": 0.1}}}}', ["no hyperparameters", "topk/16"]),
        ('{"dselect_k/16": {"hparams": {"lr": 0.01}}}', ["no hyperparameters", "topk/16"]),
        ('{"hparams": {"topk": {"32": {"lr": 0.01}}}}', ["topk/16"]),
    ],
)
def test_synthetic_bad_tuned_files_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: list[str]
) -> None:
    tuned = tmp_path / "mine.json"
    tuned.write_text(text)
    assert main([*SYN, "--tuned", str(tuned), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tuned" in err and "mine.json" in err
    assert all(w in err for w in words), err
    assert not (tmp_path / "o" / "runs").exists()  # refused before any training


@pytest.mark.parametrize("kind", ["missing", "folder", "empty"])
def test_tuned_path_that_is_not_a_file_is_refused_by_argparse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    path = {"missing": str(tmp_path / "nope.json"), "folder": str(tmp_path), "empty": ""}[kind]
    for argv in (SYN, REC):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--tuned", path, "--out", str(tmp_path / "o")])
        assert e.value.code == 2
        assert "argument --tuned" in capsys.readouterr().err


def test_recovery_tuned_file_missing_the_variant_or_malformed_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tuned = tmp_path / "rec.json"
    tuned.write_text(json.dumps({"hparams": {"dselect_k": {"gamma": 1.0}}}))
    assert main([*REC, "--tuned", str(tuned), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "rec.json" in err and "topk" in err and "no hyperparameters" in err
    tuned.write_text("{")
    assert main([*REC, "--tuned", str(tuned), "--out", str(tmp_path / "o")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main([*SYN, "--full", "--tuned", str(tuned), "--out", str(tmp_path / "o")]) == 2
    assert "--full" in capsys.readouterr().err


def test_tuned_file_credited_by_content_and_identity_follows_content(tmp_path: Path) -> None:
    out = tmp_path / "o"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    body = {"source": "my search", "hparams": {"topk": {"default": {"lr": 0.02, "epochs": 1}}}}
    a.write_text(json.dumps(body))
    b.write_text(json.dumps(body, indent=2))  # same hyperparameters, other bytes and name
    assert main([*SYN, "--tuned", str(a), "--out", str(out)]) == 0
    sel = json.loads((out / "selected_hparams.json").read_text())["topk/16"]
    from dselectk_research.args import file_digest

    assert sel["source"] == f"my search (--tuned {a}, sha256 {file_digest(a)})"
    assert file_digest(a) in (out / "report.md").read_text()
    (first,) = RunStore(out).load()
    # the same hyperparameters under another name: the same run (reused, nothing retrained)
    assert main([*SYN, "--tuned", str(b), "--out", str(out)]) == 0
    assert [r["run_id"] for r in RunStore(out).load()] == [first["run_id"]]
    sel = json.loads((out / "selected_hparams.json").read_text())["topk/16"]
    assert file_digest(b) in sel["source"]  # the report credits the file used last
    # the same name with other content: another run
    body["hparams"]["topk"]["default"]["lr"] = 0.05
    a.write_text(json.dumps(body))
    assert main([*SYN, "--tuned", str(a), "--out", str(out)]) == 0
    assert len(RunStore(out).load()) == 2
    assert _summary(out)["records"] == 1  # the report summarises the current file's run only


def test_overrides_are_credited_to_the_command_line_not_the_record(tmp_path: Path) -> None:
    out = tmp_path / "o"
    tuned = tmp_path / "t.json"
    body = {"source": "my search", "hparams": {"topk": {"default": {"lr": 0.02, "epochs": 1}}}}
    tuned.write_text(json.dumps(body))
    assert main([*SYN, "--tuned", str(tuned), "--lr", "0.03", "--out", str(out)]) == 0
    sel = json.loads((out / "selected_hparams.json").read_text())["topk/16"]
    assert sel["hparams"]["lr"] == 0.03 and sel["hparams"]["epochs"] == 1
    # --epochs 1 (in SYN) is the record's own value: the record is credited with it
    assert sel["source"].endswith("), with --lr 0.03 from the command line")
    assert "with --lr 0.03 from the command line" in (out / "report.md").read_text()
    # without a changed value the record alone is credited
    plain = tmp_path / "p"
    assert main([*SYN, "--tuned", str(tuned), "--out", str(plain)]) == 0
    sel = json.loads((plain / "selected_hparams.json").read_text())["topk/16"]
    assert "command line" not in sel["source"]


def test_recovery_report_credits_the_tuned_file(tmp_path: Path) -> None:
    out = tmp_path / "o"
    tuned = tmp_path / "t.json"
    tuned.write_text(json.dumps({"hparams": {"topk": {"epochs": 1}}}))
    assert main([*REC, "--tuned", str(tuned), "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert f"--tuned {tuned} (sha256 " in report and "shipped" not in report


# -- garbled results folders -------------------------------------------------------------------
@pytest.fixture(scope="module")
def done_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("done") / "syn"
    assert main([*SYN, "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize(
    ("record", "words"),
    [
        ("[1]", "a JSON list"),
        ('{"metrics": {}}', "'config' missing"),
        ('{"config": {"experiment": "synthetic"}, "metrics": 3}', "'metrics' missing"),
        ('{"config": {"experiment": "nope"}, "metrics": {}}', "unknown experiment 'nope'"),
    ],
)
def test_report_on_garbled_records_refuses_and_keeps_the_report(
    done_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], record: str, words: str
) -> None:
    import shutil

    out = tmp_path / "g"
    shutil.copytree(done_folder, out)
    before = (out / "report.md").read_text(), (out / "summary.json").read_text()
    (first,) = sorted((out / "runs").glob("*.json"))
    first.write_text(record)
    assert main(["report", str(out)]) == 2  # was KeyError / TypeError tracebacks
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert ((out / "report.md").read_text(), (out / "summary.json").read_text()) == before


@pytest.mark.parametrize("name", ["selected_hparams.json", "summary.json"])
@pytest.mark.parametrize("text", ["{", "[1, 2]"])
def test_report_rebuilds_over_garbled_extras(
    done_folder: Path, tmp_path: Path, name: str, text: str
) -> None:
    import shutil

    out = tmp_path / "g"
    shutil.copytree(done_folder, out)
    (out / name).write_text(text)
    assert main(["report", str(out)]) == 0  # selected_hparams.json "{" was a bare JSON error
    assert _summary(out)["records"] == 1


def test_report_of_a_file_or_missing_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "f").write_text("x")
    assert main(["report", str(tmp_path / "f")]) == 2
    assert "is a file" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err


# -- memory estimates, duplicated values, executors, bench -------------------------------------
def test_sizes_that_cannot_fit_are_refused_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dselectk_research import multi_mnist as mm
    from dselectk_research.args import check_fits

    config = mm.MultiMNISTConfig(out=tmp_path, gates=("softmax",), n_train=10_000_000)
    with pytest.raises(ValueError, match=r"--n-train/--n-val/--n-test.*GiB"):
        mm.check_memory(config, total=16 * 2**30)
    mm.check_memory(mm.MultiMNISTConfig(out=tmp_path, gates=("softmax",)), total=16 * 2**30)
    with pytest.raises(ValueError, match="lower them"):
        check_fits(2**40, "x", total=2**30)
    huge = [*SYN, "--n-train", "1000000000", "--out", str(tmp_path / "o")]
    assert main(huge) == 2 and "--n-train/--n-eval" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_repeated_list_values_are_one_cell(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert main([*SYN[:5], "topk", "topk", *SYN[6:], "--out", str(out)]) == 0
    assert list(json.loads((out / "selected_hparams.json").read_text())) == ["topk/16"]
    assert _summary(out)["records"] == 1


def test_slurm_submission_failure_is_one_line(tmp_path: Path) -> None:
    from dselectk_research import slurm

    class FailedJobError(RuntimeError):
        pass

    class Refusing:
        def map_array(self, *a: Any) -> Any:
            raise FailedJobError("sbatch: error: Batch job submission failed: no controller")

    import dataclasses
    from types import SimpleNamespace

    @dataclasses.dataclass(frozen=True)
    class Config:
        out: Path

    recipe = SimpleNamespace(cells=["a"], cell_name=str)
    opts = slurm.SlurmOptions()
    with pytest.raises(OSError, match="submission failed: sbatch: error: Batch job"):
        slurm.run_slurm(
            recipe, Config(tmp_path), tmp_path, opts, progress=False,
            on_cell=lambda *a: None, make_executor=lambda f, o: Refusing(), states=lambda ids: {},
        )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--threads", "-1"], "--threads"),
        (["--device", "gpu"], "--device"),
        (["--small-batches", "0"], "--small-batches"),
        (["--small-reps", "-2"], "--small-reps"),
        (["--out", ""], "--out"),
    ],
)
def test_bench_flags_are_typed(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))  # the checkout
    import importlib

    suite = importlib.import_module("benchmarks.suite")

    with pytest.raises(SystemExit) as e:
        suite.build_parser().parse_args(argv)
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
