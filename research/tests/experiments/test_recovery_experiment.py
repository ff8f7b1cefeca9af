"""Expert recovery experiment (Appendix C.2.2): data, model, CLI, report from records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dselectk.cli import main
from dselectk_research import recovery as R
from dselectk_research.report import experiment_name


def test_data_deterministic_and_balanced() -> None:
    a, b = R.RecoveryData(0), R.RecoveryData(0)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_val, b.y_val)
    assert a.x_train.shape == (10_000, 10) and a.x_val.shape == (10_000, 10)
    assert 0.45 < float(torch.cat([a.y_train, a.y_val]).mean()) < 0.55
    assert not torch.equal(a.y_train, R.RecoveryData(1).y_train)


def test_model_holds_exact_copies_of_the_true_experts() -> None:
    data = R.RecoveryData(0)
    m = R.RecoveryMoE.from_seeds(R.VARIANTS["topk"], R.BASE_HPARAMS, data, [5, 6, 7])
    assert m.true_mask.sum(-1).tolist() == [4, 4, 4]
    for r in range(3):
        pos = m.true_mask[r].nonzero().flatten()
        got = {tuple(m.experts[r, i].flatten().tolist()) for i in pos}
        want = {tuple(w.flatten().tolist()) for w in data.true_experts}
        assert got == want
    assert not any(p.requires_grad for p in [m.experts])
    single = R.RecoveryMoE.from_seeds(R.VARIANTS["topk"], R.BASE_HPARAMS, data, [6])
    assert torch.equal(single.experts[0], m.experts[1])
    assert torch.equal(single.gates.logits[0], m.gates.logits[1])


def test_batched_equals_one_at_a_time() -> None:
    data = R.RecoveryData(0)
    hp = {**R.BASE_HPARAMS, "lr": 0.01, "epochs": 1, "gamma": 1.0, "entropy_reg": 0.01}
    both, _ = R.train_reps(
        R.VARIANTS["dselect_k"], hp, data, [1, 2], shuffle_seed=0, lrs=[0.1, 0.01]
    )
    one, _ = R.train_reps(R.VARIANTS["dselect_k"], hp, data, [2], shuffle_seed=0)
    for k in one[0]:
        assert both[1][k] == pytest.approx(one[0][k], rel=1e-4, abs=1e-5), k


def test_cli_smoke_resume_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rec"
    argv = [
        "reproduce",
        "recovery",
        "--out",
        str(out),
        "--reps",
        "2",
        "--epochs",
        "1",
        "--lrs",
        "0.1",
        "0.01",
        "--gates",
        "dselect_k",
        "topk",
        "--no-progress",
        "--record-every",
        "5",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "recovered" in printed and "Top-k" in printed
    runs = sorted((out / "runs").glob("*.json"))
    assert len(runs) == 2 * 2 * 2
    mtimes = {p.name: p.stat().st_mtime_ns for p in runs}
    assert main(argv) == 0  # nothing to redo
    assert {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")} == mtimes
    assert experiment_name(out) == "recovery"
    for name in ["summary.json", "report.md", "trajectory_topk.png", "trajectory_dselect_k.png"]:
        (out / name).unlink()
    assert main(["report", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {r["gate"] for r in summary["selected"]} == {"dselect_k", "topk"}
    assert (out / "trajectory_topk.png").is_file()
    assert "1/4" in (out / "report.md").read_text()
    assert "DSelect-k CPU kernel (DSELECTK_KERNEL): " in (out / "report.md").read_text()


def test_report_without_records_fails_cleanly(tmp_path: Path) -> None:
    assert main(["report", str(tmp_path)]) == 2  # a user error: one line, exit code 2


def test_telemetry_flag_logs_collisions_per_repetition(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    argv = ["reproduce", "recovery", "--out", str(out), "--reps", "2", "--lrs", "0.1",
            "--gates", "dselect_k", "--epochs", "1", "--no-progress", "--jobs", "1",
            "--telemetry", "--record-every", "20"]  # fmt: skip
    assert main(argv) == 0
    files = list((out / "telemetry" / "dselect_k").iterdir())
    assert files  # TensorBoard event file, or routing.jsonl without the extra
    jsonl = out / "telemetry" / "dselect_k" / "routing.jsonl"
    if jsonl.is_file():
        rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
        assert [r["step"] for r in rows] == [20, 40]  # 40 steps per epoch
        gates = rows[-1]["gates"]
        assert sorted(gates) == ["gates/task0", "gates/task1"]  # one per repetition
        assert all(0 <= g["collisions"] <= 6 for g in gates.values())


def test_a_held_out_shape_trains_and_reports_it(tmp_path: Path) -> None:
    data = R.RecoveryData(0, n_train=512, n_val=256, num_true=3)
    assert data.true_experts.shape == (3, 10, 4)
    hp = {**R.BASE_HPARAMS, "lr": 0.1, "epochs": 2}
    m = R.RecoveryMoE.from_seeds(R.VARIANTS["dselect_k"], hp, data, [1, 2], experts=32, k=3)
    assert m.experts.shape == (2, 32, 10, 4) and m.true_mask.sum(-1).tolist() == [3, 3]
    metrics, _ = R.train_reps(R.VARIANTS["topk"], hp, data, [1, 2], shuffle_seed=0, experts=32)
    assert all(r["experts_selected"] == 3.0 and 0 <= r["recovered"] <= 3 for r in metrics)
    out = tmp_path / "rec"
    argv = ["reproduce", "recovery", "--out", str(out), "--experts", "32", "--true-experts", "3",
            "--k", "2", "--reps", "1", "--lrs", "0.1", "--epochs", "1", "--gates", "topk",
            "--no-progress", "--jobs", "1"]  # fmt: skip
    assert main(argv) == 0
    (run,) = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert run["config"]["shape"] == {"experts": 32, "true": 3, "k": 2}
    assert run["metrics"]["experts_selected"] == 2.0
    assert "32 experts, 3 true, k = 2" in (out / "report.md").read_text()
    assert json.loads((out / "summary.json").read_text())["selected"][0]["recovered_histogram"] == [
        int(run["metrics"]["recovered"] == i) for i in range(4)
    ]


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--experts", "1"], "--experts"),
        (["--true-experts", "0"], "--true-experts"),
        (["--true-experts", "17"], "--true-experts"),
        (["--experts", "8", "--true-experts", "4", "--k", "9"], "--k"),
        (["--k", "0"], "--k"),
        (["--gates", "dselect_k_spread"], "--gates"),
    ],
)
def test_bad_shape_flags_exit_2_naming_the_flag(
    flags: list[str], name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["reproduce", "recovery", "--out", str(tmp_path / "out"), *flags])
    except SystemExit as e:  # refused by argparse
        code = int(e.code or 0)
    assert code == 2
    assert f"argument {name}" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()  # refused before any work


def test_help_lists_each_variant_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["reproduce", "recovery", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.count(", ".join(R.VARIANTS)) == 1 and "{dselect" not in text
    assert text.count("comet") == 1 and "dselect_k_spread" not in text and "--true-experts" in text


def test_a_bad_tuned_file_is_one_line_naming_file_and_key(tmp_path: Path) -> None:
    from dselectk_research.recovery.recipe import tuned_hparams

    bad = tmp_path / "tuned.json"
    bad.write_text(json.dumps({"hparams": {"dselect_k": {"gamma": -1.0, "epochs": 1}}}))
    with pytest.raises(ValueError, match=r"tuned.json: hparams.dselect_k.gamma: expected"):
        tuned_hparams(R.VARIANTS["dselect_k_search"], bad)
