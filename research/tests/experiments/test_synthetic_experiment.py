"""Appendix C.1 study: batched vs sequential training, resumable sweep, report, CLI (the data
generator's tests are tests/data/test_synthetic_data.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from benchmarks.synthetic_reference import fused_loss, reference_loss, train_sequential

from dselectk._testing import PAUSE_ENV
from dselectk.cli import main
from dselectk.models import bank
from dselectk_research import synthetic as S
from dselectk_research.synthetic import recipe as synthetic_recipe

TINY = ["--n-train", "1024", "--n-eval", "256", "--epochs", "1", "--no-progress", "--jobs", "1"]


@pytest.mark.parametrize("gate", ["dselect_k", "topk", "ablation_annealing", "ablation_entropy"])
def test_batched_equals_sequential(gate: str) -> None:
    data = S.generate_data(0, n_train=768, n_val=128, n_test=128)
    hp = {
        **S.BASE_HPARAMS,
        "epochs": 2,
        "lr": 0.01,
        "entropy_reg": 0.01,
        "temperature": 1e-3,
    }
    seeds = [11, 12, 13]
    batched = S.train_reps(gate, 32, hp, seeds, data, shuffle_seed=5)
    assert isinstance(batched, dict)
    seq = train_sequential(gate, 32, hp, seeds, data, shuffle_seed=5)
    for b, s in zip(batched[2], seq):
        assert b.keys() == s.keys()
        for k in b:
            assert b[k] == pytest.approx(s[k], rel=1e-4, abs=1e-5), k
    # repetitions are independent: a different repetition set does not change rep 11
    alone = S.train_reps(gate, 32, hp, [11, 99], data, shuffle_seed=5)
    assert isinstance(alone, dict)
    assert alone[2][0]["test_mse"] == pytest.approx(batched[2][0]["test_mse"], rel=1e-4)


def test_batched_model_parameters_match_single_models() -> None:
    m = S.build_model("dselect_k", 32, S.BASE_HPARAMS, [3, 4])
    single = S.build_model("dselect_k", 32, S.BASE_HPARAMS, [4])
    assert torch.equal(m.gates.logits[32:], single.gates.logits)
    assert torch.equal(m.experts.weights[0][8:], single.experts.weights[0])


@pytest.mark.parametrize("gate", ["dselect_k", "topk", "ablation_entropy"])
def test_fused_loss_equals_autograd_reference(gate: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path (_MixtureSSE) gives the reference loss and the same parameter gradients."""
    monkeypatch.setattr(bank, "LOSS_BLOCK_WEIGHTS", 32 * 8 * 5)  # blocks of 5 repetitions
    hp = {**S.BASE_HPARAMS, "entropy_reg": 0.01}
    data = S.generate_data(1, n_train=300, n_val=8, n_test=8)
    x, y = data.x_train[:256], data.y_train[:256, :32]
    grads = []
    for loss_fn in (fused_loss, reference_loss):
        m = S.build_model(gate, 32, hp, list(range(5, 17)))  # 12 reps: blocks 5, 5, 2
        loss = loss_fn(m, x, y)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in m.parameters()]))
    (fast, g_fast), (ref, g_ref) = grads
    assert fast == pytest.approx(ref, rel=1e-5)
    with torch.no_grad():  # no gradients wanted: the loss alone
        assert fused_loss(m, x, y).item() == pytest.approx(ref, rel=1e-5)
    for a, b in zip(g_fast, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "reproduce",
        "synthetic",
        "--out",
        str(out),
        "--tasks",
        "16",
        "32",
        "--gates",
        "topk",
        "dselect_k",
        "--reps",
        "2",
        *TINY,
        *extra,
    ]


def test_cli_smoke_and_report_rebuild(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "res"
    assert main(_args(out)) == 0
    printed = capsys.readouterr().out
    assert "Top-k" in printed and "test MSE" in printed
    records = list((out / "runs").glob("*.json"))
    assert len(records) == 2 * 2 * 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiment"] == "synthetic"
    assert {r["num_tasks"] for r in summary["rows"]} == {16, 32}
    assert all(r["metrics"]["test_mse"]["n"] == 2 for r in summary["rows"])
    rec = json.loads(records[0].read_text())
    assert rec["environment"]["dselectk"] and "git_commit" in rec["environment"]
    assert rec["config"]["experiment"] == "synthetic"
    # rebuild from records alone
    generated = [
        "summary.json",
        "report.md",
        "fig_c1.png",
        "mse_vs_tasks.png",
        "jaccard_related_vs_tasks.png",
        "jaccard_unrelated_vs_tasks.png",
    ]
    for name in generated:
        (out / name).unlink()
    assert main(["report", str(out)]) == 0
    for name in generated:
        assert (out / name).is_file(), name
    text = (out / "report.md").read_text()
    assert "paper" in text.lower() and "8 groups of 16" in text


class _Crash(RuntimeError):
    """Stands in for Ctrl-C / a crash inside a training job."""


def test_interrupted_sweep_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "res"
    calls: list[tuple[str, int, int]] = []
    crash = [True]
    real = S.train_reps

    def flaky(gate: str, t: int, hp: object, seeds: list[int], *a: object, **kw: object) -> object:
        calls.append((gate, t, len(seeds)))
        if crash[0] and len(calls) == 3:
            raise _Crash  # as if the sweep died inside the third training job
        return real(gate, t, hp, seeds, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(synthetic_recipe, "train_reps", flaky)
    parser = argparse.ArgumentParser()
    S.add_arguments(parser)
    argv = [
        "--out",
        str(out),
        "--tasks",
        "16",
        "32",
        "--gates",
        "topk",
        "--reps",
        "3",
        "--batch-reps",
        "1",
        *TINY,
    ]
    with pytest.raises(_Crash):
        S.run(parser.parse_args(argv))
    done = sorted((out / "runs").glob("*.json"))
    assert len(done) == 2  # two finished jobs, nothing from the interrupted one
    assert not list((out / "runs").glob(".*tmp"))
    mtimes = {p.name: p.stat().st_mtime_ns for p in done}
    calls.clear()
    crash[0] = False
    assert S.run(parser.parse_args(argv)) == 0
    assert len(calls) == 6 - 2  # finished runs are not redone
    after = sorted((out / "runs").glob("*.json"))
    assert len(after) == 6
    for p in done:
        assert p.stat().st_mtime_ns == mtimes[p.name]


def _start_then_kill_9(
    cmd: list[str], env: dict[str, str], barrier: Path, point: str, count: int
) -> list[int]:
    """Start a sweep that pauses at ``point`` the ``count``-th time it gets there (see
    ``dselectk._testing``), wait for it to get there, kill -9 it; returns the pids of its child
    processes just before the kill. Deterministic: the kill always lands at that point."""
    env = {**env, PAUSE_ENV: f"{point}@{count}@{barrier}"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300  # bounds a broken test only; the pause makes it exact
        while not barrier.is_file():
            assert proc.poll() is None, "the sweep ended before its pause point"
            assert time.time() < deadline, "the sweep never reached its pause point"
            time.sleep(0.02)
        children = _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return children


def _resume_keeps_finished_records(
    cmd: list[str], env: dict[str, str], runs: Path, first: dict[str, int]
) -> None:
    """Rerun the killed sweep: all 8 records, the finished ones not redone, no temp files."""
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    final = {p.name: p.stat().st_mtime_ns for p in runs.glob("*.json")}
    assert len(final) == 8
    for name, mt in first.items():
        assert final[name] == mt  # not redone
    assert not list(runs.glob(".*tmp"))


def test_kill_9_mid_sweep_then_resume(tmp_path: Path) -> None:
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "dselectk.cli", *_args(out, "--batch-reps", "1")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = out / "runs"
    _start_then_kill_9(cmd, env, tmp_path / "barrier", "record-saved", 2)
    first = {p.name: p.stat().st_mtime_ns for p in runs.glob("*.json")}
    assert len(first) == 2, "the kill lands right after the second record"
    for p in runs.glob("*.json"):
        json.loads(p.read_text())  # every visible record is complete
    _resume_keeps_finished_records(cmd, env, runs, first)


def test_kill_9_mid_record_write_then_resume(tmp_path: Path) -> None:
    """Killed while the third record's temp file is complete but not yet renamed: two records
    are visible, the temp file of the dead process is removed on resume, all 8 end complete."""
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "dselectk.cli", *_args(out, "--batch-reps", "1")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = out / "runs"
    _start_then_kill_9(cmd, env, tmp_path / "barrier", "before-replace/runs", 3)
    first = {p.name: p.stat().st_mtime_ns for p in runs.glob("*.json")}
    assert len(first) == 2
    assert len(list(runs.glob(".*.tmp"))) == 1  # the dead process's complete temp file
    _resume_keeps_finished_records(cmd, env, runs, first)


def test_grid_search_selects_on_validation_and_reuses_records(tmp_path: Path) -> None:
    from dselectk_research.records import RunStore

    data = S.generate_data(0, n_train=512, n_val=128, n_test=128)
    grid = {
        **S.paper_grid(S.VARIANTS["dselect_k"]),
        "lr": [0.01],
        "epochs": [1, 2],
        "gamma": [10.0],
        "entropy_reg": [0.01, 1.0],
    }
    store = RunStore(tmp_path)
    cfg = {"seed": 0, "n_train": 512, "n_eval": 128}
    choice = S.tune("dselect_k", 16, data, store, grid=grid, trials=2, data_cfg=cfg, progress=False)
    recs = store.load()
    assert len(recs) == 2 * 2 * 2  # 2 λ × 2 epoch checkpoints × 2 trials, one run per λ
    assert choice["configs_tried"] == 4
    assert choice["hparams"]["entropy_reg"] in (0.01, 1.0)
    if choice["binary"]:
        assert choice["configs_binary"] >= 1
    again = S.tune("dselect_k", 16, data, store, grid=grid, trials=2, data_cfg=cfg, progress=False)
    assert again == choice and len(store.load()) == len(recs)


def test_full_protocol_smoke(tmp_path: Path) -> None:
    out = tmp_path / "full"
    argv = [
        "reproduce",
        "synthetic",
        "--full",
        "--max-points",
        "1",
        "--trials",
        "1",
        "--tasks",
        "16",
        "--gates",
        "dselect_k",
        "--reps",
        "1",
        "--n-train",
        "256",
        "--n-eval",
        "64",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    sel = json.loads((out / "selected_hparams.json").read_text())
    assert set(sel) == {"dselect_k/16"} and "configs_binary" in sel["dselect_k/16"]
    assert "grid search" in (out / "report.md").read_text()

    # the final phase again, from the selections alone (--tuned selected_hparams.json)
    again = tmp_path / "again"
    i = argv.index("--full")  # with the flags only --full uses (refused without it)
    argv2 = [*argv[:i], *argv[i + 5 :], "--tuned", str(out / "selected_hparams.json")]
    argv2[argv2.index("--out") + 1] = str(again)
    assert main(argv2) == 0

    def finals(d: Path) -> dict[str, dict[str, object]]:
        recs = [json.loads(p.read_text()) for p in (d / "runs").glob("*.json")]
        return {
            json.dumps(r["config"], sort_keys=True): r["metrics"]
            for r in recs
            if r["config"]["phase"] == "final"
        }

    assert finals(again).keys() == finals(out).keys() and len(finals(out)) == 1
    assert f"selections of {out / 'selected_hparams.json'}" in (again / "report.md").read_text()


def test_tuned_file_errors_name_the_flag(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"dselect_k": {"lr": 0.1}}')
    with pytest.raises(ValueError, match=r"--tuned .*gate/T"):
        S.load_tuned(bad)
    with pytest.raises(ValueError, match=r"--tuned .*cannot read"):
        S.load_tuned(tmp_path / "missing.json")
    # entries are checked against the variant's declared hyperparameters: one line, file and key
    bad.write_text('{"hparams": {"topk": {"default": {"lr": 0.1, "gamma": 5}}}}')
    with pytest.raises(ValueError, match=r"--tuned .*bad.json: topk/default: gate 'topk' has no "
                       r"hyperparameter 'gamma'") as e:  # fmt: skip
        S.load_tuned(bad)
    assert "\n" not in str(e.value)
    bad.write_text('{"hparams": {"dselect_k": {"default": {"lr": 0.1, "gamma": -1}}}}')
    with pytest.raises(ValueError, match=r"bad.json: dselect_k/default.gamma: expected a number"):
        S.load_tuned(bad)


def test_the_shipped_tuning_record_is_valid() -> None:
    tuned = S.load_tuned()
    assert set(tuned["hparams"]) <= set(S.VARIANTS)
    hp = S.resolve_hparams("ablation_annealing", 32, tuned, {"gamma": 3.0, "temperature": 0.5})
    assert hp == {"lr": 0.01, "epochs": 10, "temperature": 0.5}  # γ is not an annealing one
    assert S.resolve_hparams("topk", 32, tuned, {"entropy_reg": 1.0}) == {"lr": 0.01, "epochs": 10}


def test_flag_ramps_are_ramps_of_the_variants_that_take_the_hyperparameter() -> None:
    from dselectk.variants import Ramp

    args = argparse.Namespace(out=Path("x"), gates=["dselect_k"], tasks=[16])
    base = synthetic_recipe.config_from_args(synthetic_recipe.SyntheticConfig, args)
    c = dataclasses.replace(base, gamma_end=0.1, entropy_reg_end=1.0, entropy_warmup=0.2)
    assert c.variant("dselect_k").schedules == (
        Ramp("gamma", end=0.1, shape="geometric"),
        Ramp("entropy_reg", end=1.0, delay=0.2, before=0.0),
    )
    assert c.variant("ablation_entropy").schedules == (
        Ramp("entropy_reg", end=1.0, delay=0.2, before=0.0),
    )
    assert c.variant("topk") is S.VARIANTS["topk"]
    assert c.variant("ablation_annealing") is S.VARIANTS["ablation_annealing"]
    assert base.variant("dselect_k") is S.VARIANTS["dselect_k"]
    assert c.shape(64) == {"num_experts": 16, "k": 4}


def test_shape_options_run_and_the_records_carry_the_shape(tmp_path: Path) -> None:
    out = tmp_path / "shape"
    argv = ["reproduce", "synthetic", "--tasks", "16", "--gates", "dselect_k", "topk",
            "--reps", "1", "--experts", "6", "--k", "3", "--out", str(out), *TINY]  # fmt: skip
    assert main(argv) == 0
    recs = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert len(recs) == 2
    for r in recs:
        assert (r["config"]["num_experts"], r["config"]["k"]) == (6, 3)
        assert len(r["weights"][0]) == 6  # (T, E) weights of repetition 0
        if r["config"]["gate"] == "topk":  # exactly k = 3 (DSelect-k is not binary yet)
            assert r["metrics"]["experts_per_task_max"] == 3
    summary = json.loads((out / "summary.json").read_text())
    assert all(r["shape"] == {"num_experts": 6, "k": 3} for r in summary["rows"])


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--k", "0"], "argument --k"),
        (["--experts", "0"], "argument --experts"),
        (["--entropy-warmup", "1.0"], "argument --entropy-warmup"),
        (["--diversity", "1.0"], "unrecognized arguments: --diversity"),
        (["--sequential"], "unrecognized arguments: --sequential"),
    ],
)
def test_bad_shape_and_retired_flags_exit_2(
    flags: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["reproduce", "synthetic", "--out", str(tmp_path / "x"), *flags])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_k_above_the_experts_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flags in (["--k", "5"], ["--experts", "3"]):  # T = 16: 4 experts by default; k = 4
        assert main(["reproduce", "synthetic", "--out", str(tmp_path / "x"), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--k" in err[0] and "experts" in err[0]
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("gate", "members"),
    [
        (
            "dselect_k",
            [
                {"lr": 0.01, "gamma": 5.0, "entropy_reg": 0.1},
                {"lr": 0.1, "gamma": 15.0, "entropy_reg": 0.001},
                {"lr": 0.001, "gamma": 10.0, "entropy_reg": 0.0},
            ],
        ),
        ("topk", [{"lr": 0.01}, {"lr": 0.1}]),
        ("ablation_entropy", [{"lr": 0.01, "entropy_reg": 1.0}, {"lr": 0.1, "entropy_reg": 1e-4}]),
        (
            "ablation_annealing",
            [
                {"lr": 0.01, "temperature": 1e-3, "epochs": 1},
                {"lr": 0.1, "temperature": 1.0, "epochs": 2},
            ],
        ),
    ],
)
def test_configurations_trained_together_equal_separate_runs(
    gate: str, members: list[dict[str, float]]
) -> None:
    """Different lr / γ / λ / temperature schedules in one batched model = one run each."""
    data = S.generate_data(0, n_train=512, n_val=128, n_test=128)
    base = {**S.BASE_HPARAMS, "epochs": 2}
    seeds = [21 + i for i in range(len(members))]
    cps = [1, 2]
    together = S.train_reps(
        gate, 32, base, seeds, data, shuffle_seed=3, checkpoints=cps, member_hparams=members
    )
    assert isinstance(together, dict)
    for i, (m, s) in enumerate(zip(members, seeds, strict=True)):
        hp = {**base, **m}
        own = [e for e in cps if e <= int(hp["epochs"])]
        alone = S.train_reps(gate, 32, hp, [s], data, shuffle_seed=3, checkpoints=own)
        assert isinstance(alone, dict)
        e = int(hp["epochs"])  # a member's own schedule ends at its own epochs
        for key, value in alone[e][0].items():
            assert together[e][i][key] == pytest.approx(value, rel=2e-3, abs=1e-5), (i, key)


def test_jobs_processes_write_the_same_records(tmp_path: Path) -> None:
    """--jobs 2 runs the (gate, T) cells in two spawned processes: same records, same metrics."""
    serial, pooled = tmp_path / "serial", tmp_path / "pooled"
    assert main(_args(serial, "--threads", "1")) == 0
    assert main(_args(pooled, "--jobs", "2", "--threads", "1")) == 0
    a = {p.name: json.loads(p.read_text()) for p in (serial / "runs").glob("*.json")}
    b = {p.name: json.loads(p.read_text()) for p in (pooled / "runs").glob("*.json")}
    assert len(a) == 8 and a.keys() == b.keys()
    for name, rec in a.items():
        assert rec["config"] == b[name]["config"]
        for key, value in rec["metrics"].items():
            if isinstance(value, float):
                assert b[name]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    sel_a = json.loads((serial / "selected_hparams.json").read_text())
    sel_b = json.loads((pooled / "selected_hparams.json").read_text())
    assert sel_a == sel_b and list(sel_a) == list(sel_b)


def test_jobs_must_not_be_negative(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # refused by the flag's type, before any work
        main(_args(tmp_path / "x", "--jobs", "-1"))
    assert e.value.code == 2 and "--jobs" in capsys.readouterr().err


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_a_jobs_sweep_stops_its_workers_then_resumes(tmp_path: Path) -> None:
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "dselectk.cli", *_args(out, "--batch-reps", "1", "--jobs", "2")]
    cmd[cmd.index("--epochs") + 1] = "3"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = out / "runs"
    workers = _start_then_kill_9(cmd, env, tmp_path / "barrier", "record-saved", 1)
    assert workers, "no worker processes seen"
    deadline = time.time() + 120  # bounds a broken test only: passes as soon as they exit
    while time.time() < deadline and any(map(_alive, workers)):
        time.sleep(0.05)
    assert not any(map(_alive, workers)), "workers outlived the killed sweep"
    first = {p.name: p.stat().st_mtime_ns for p in runs.glob("*.json")}
    assert 1 <= len(first) <= 2, "each worker pauses after its first record"
    _resume_keeps_finished_records(cmd, env, runs, first)


def test_telemetry_flag_logs_each_epoch_without_changing_records(tmp_path: Path) -> None:
    """--telemetry logs routing once per epoch and changes no record."""
    argv = ["reproduce", "synthetic", "--tasks", "16", "--gates", "dselect_k", "--reps", "2",
            *TINY, "--epochs", "2"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "plain")]) == 0
    assert main([*argv, "--out", str(tmp_path / "tel"), "--telemetry"]) == 0
    (run,) = list((tmp_path / "tel" / "telemetry").iterdir())
    assert run.name == "dselect_k-T16-reps0-1" and list(run.iterdir())
    jsonl = run / "routing.jsonl"
    if jsonl.is_file():  # JSON lines without the tensorboard extra
        rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
        assert [r["step"] for r in rows] == [4, 8]  # 1024 rows / 256 = 4 steps per epoch
        assert len(rows[-1]["gates"]) == 2 * 16  # repetitions × tasks
    plain = sorted((tmp_path / "plain" / "runs").glob("*.json"))
    tel = sorted((tmp_path / "tel" / "runs").glob("*.json"))
    assert [p.name for p in plain] == [p.name for p in tel]
    for a, b in zip(plain, tel, strict=True):
        assert json.loads(a.read_text())["metrics"] == json.loads(b.read_text())["metrics"]


def test_grid_search_of_a_search_variant_batches_one_epoch_count_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swap-search schedule is a fraction of the batch's run, so a 1-epoch member must not
    be read off the first epoch of a 2-epoch batch (it would not have been binarized)."""
    from dselectk_research.records import RunStore
    from dselectk_research.synthetic import train as st

    data = S.generate_data(0, n_train=512, n_val=128, n_test=128)
    grid = {**S.paper_grid(S.VARIANTS["dselect_k"]), "lr": [0.01], "epochs": [1, 2]}
    grid.update(gamma=[10.0], entropy_reg=[0.1])
    seen: list[list[int]] = []
    real = st.train_reps

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        seen.append(sorted({int(m["epochs"]) for m in kw["member_hparams"]}))
        return real(*args, **kw)

    monkeypatch.setattr(st, "train_reps", spy)
    cfg = {"seed": 0, "n_train": 512, "n_eval": 128}
    choice = st.tune(
        "dselect_k_search",
        16,
        data,
        RunStore(tmp_path),
        grid=grid,
        trials=2,
        data_cfg=cfg,
        progress=False,
    )
    assert sorted(seen) == [[1], [2]]
    assert choice["binary"]  # every configuration ends binary (the search binarizes it)


def test_grid_search_of_a_ramped_variant_batches_one_epoch_count_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command-line ramp (here λ linear after a warm-up) spans each run: epochs is a grid
    axis and each batch holds one epoch count (a linear ramp has no per-member length)."""
    from dselectk.variants import Ramp
    from dselectk_research.records import RunStore
    from dselectk_research.synthetic import train as st
    from dselectk_research.synthetic.spec import with_ramps

    v = with_ramps(S.VARIANTS["dselect_k"], [Ramp("entropy_reg", end=0.5, delay=0.5, before=0.0)])
    data = S.generate_data(0, n_train=512, n_val=128, n_test=128)
    grid = {**S.paper_grid(v), "lr": [0.01], "epochs": [1, 2], "gamma": [10.0]}
    grid["entropy_reg"] = [0.01]
    seen: list[list[int]] = []
    real = st.train_reps

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        seen.append(sorted({int(m["epochs"]) for m in kw["member_hparams"]}))
        return real(*args, **kw)

    monkeypatch.setattr(st, "train_reps", spy)
    cfg = {"seed": 0, "n_train": 512, "n_eval": 128}
    choice = st.tune(v, 16, data, RunStore(tmp_path), grid=grid, trials=1, data_cfg=cfg,
                     progress=False)  # fmt: skip
    assert sorted(seen) == [[1], [2]] and choice["configs_tried"] == 2
    recs = RunStore(tmp_path).load()
    assert all(r["config"]["variant"]["schedules"][0]["param"] == "entropy_reg" for r in recs)
