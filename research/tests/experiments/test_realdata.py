"""Tests of the real-data experiments (MovieLens, Multi-MNIST; Tables 1, 2, C.2, C.3)."""

from __future__ import annotations

import gzip
import json
import math
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from dselectk.cli import main
from dselectk.training import History
from dselectk_research import movielens as ml
from dselectk_research import multi_mnist as mm
from dselectk_research import realdata as rd
from dselectk_research.cnn import (
    BatchedCNNExperts,
    SingleCNN,
    load_from_reference,
    make_reference_cnn,
)
from dselectk_research.data import VERIFY_ENV_VAR
from dselectk_research.monitor import GateMonitor, flops_ratio, training_expert_flops
from dselectk_research.realdata import recipe as rd_recipe

# --------------------------------------------------------------------------------------------
# tiny on-disk fixtures in the upstream formats
# --------------------------------------------------------------------------------------------


def _idx(arr: np.ndarray) -> bytes:
    header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def write_mnist(root: Path, kind: str = "mnist", n_train: int = 120, n_test: int = 40) -> None:
    """Tiny IDX files: random strokes whose position depends on the label."""
    rng = np.random.default_rng(0)
    d = root / kind
    d.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        imgs = rng.integers(0, 40, (n, 28, 28)).astype(np.uint8)
        for i, lab in enumerate(labels):
            imgs[i, 4 + 2 * lab : 6 + 2 * lab, 6:22] = 255
        (d / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(imgs)))
        (d / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx(labels)))


def write_ml100k(root: Path, n_users: int = 30, n_items: int = 40) -> None:
    """Tiny u.data / u.user / u.item."""
    rng = np.random.default_rng(1)
    d = root / "movielens" / "ml-100k"
    d.mkdir(parents=True, exist_ok=True)
    rated = rng.random((n_users, n_items)) < 0.4
    rated[:, 0] = True
    users, items = np.nonzero(rated)
    lines = [
        f"{u + 1}\t{i + 1}\t{rng.integers(1, 6)}\t{880000000 + k}"
        for k, (u, i) in enumerate(zip(users, items))
    ]
    (d / "u.data").write_text("\n".join(lines) + "\n")
    occ = ("administrator", "artist", "doctor", "student", "writer")
    (d / "u.user").write_text(
        "\n".join(
            f"{u}|{20 + u}|{'MF'[u % 2]}|{occ[u % 5]}|{10000 + u}" for u in range(1, n_users + 1)
        )
        + "\n"
    )
    rows = []
    for i in range(1, n_items + 1):
        flags = ["0"] * 19
        flags[i % 19] = "1"
        rows.append(f"{i}|Film {i} (1995)|01-Jan-1995||http://x/{i}|" + "|".join(flags))
    (d / "u.item").write_bytes(("\n".join(rows) + "\n").encode("latin-1"))


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dense_layers", [1, 3])
def test_batched_cnn_experts_equal_separate_cnns(dense_layers: int) -> None:
    torch.manual_seed(0)
    refs = [make_reference_cnn(dense_layers=dense_layers) for _ in range(8)]
    bank = BatchedCNNExperts(8, dense_layers=dense_layers)
    load_from_reference(bank, refs)
    x = torch.rand(2, 1, 36, 36)
    expected = torch.stack([r(x) for r in refs])
    torch.testing.assert_close(bank(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bank(x.flatten(1)), expected, atol=1e-5, rtol=1e-5)
    members = torch.tensor([6, 1, 3])
    torch.testing.assert_close(bank(x, members), expected[members], atol=1e-5, rtol=1e-5)
    bank.channels_last = True
    torch.testing.assert_close(bank(x), expected, atol=1e-5, rtol=1e-5)
    # gradients agree too
    bank(x).sum().backward()
    sum(r(x).sum() for r in refs).backward()
    conv1 = refs[2][0]
    assert isinstance(conv1, torch.nn.Conv2d) and conv1.weight.grad is not None
    assert bank.conv1_weight.grad is not None
    torch.testing.assert_close(
        bank.conv1_weight.grad[20:30], conv1.weight.grad, atol=1e-4, rtol=1e-4
    )
    assert bank.num_members == 8 and bank.out_features == 50


def test_single_cnn_and_mnist_models_shapes() -> None:
    torch.manual_seed(0)
    assert SingleCNN()(torch.rand(3, 1296)).shape == (3, 50)
    hp = {**mm.QUICK_HPARAMS["dselect_k_static"]}
    for gate in rd.VARIANTS:
        model = mm.build_model(gate, {**mm.QUICK_HPARAMS[gate], **hp}, {})
        out = model(torch.rand(4, 1296))
        assert [o.shape for o in out.outputs] == [(4, 10), (4, 10)]
    assert mm.expert_flops({"dense_layers": 1}) == 512_000 + 1_440_000 + 72_000


def _ml_meta() -> dict[str, Any]:
    return {"num_users": 7, "num_items": 9, "side": (7, 2, 21, 19), "bottom_features": 82}


def test_movielens_model_shapes_and_loss_combination() -> None:
    torch.manual_seed(0)
    b = 5
    x = torch.cat(
        [
            torch.randint(0, 7, (b, 1)),
            torch.randint(0, 9, (b, 1)),
            torch.randint(0, 7, (b, 1)),
            torch.randint(0, 2, (b, 1)),
            torch.randint(0, 21, (b, 1)),
            torch.randint(0, 2, (b, 19)),
        ],
        dim=1,
    )
    for gate in rd.VARIANTS:
        model = ml.build_model(gate, ml.QUICK_HPARAMS[gate], _ml_meta())
        out = model(x)
        assert [o.shape for o in out.outputs] == [(b, 1), (b, 1)]
    # masked MSE: negatives weigh 0, mean over the whole batch (Keras sample_weight semantics)
    pred = torch.tensor([[4.0], [1.0], [3.0], [0.5]])
    y = torch.tensor([[5.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    assert float(ml.masked_mse(pred, y)) == pytest.approx((1.0 + 4.0) / 4)
    # α·CE + (1 − α)·task-2 loss
    assert ml._task_weights(0.1) == pytest.approx([0.1, 0.9])
    model = ml.build_model("softmax", ml.QUICK_HPARAMS["softmax"], _ml_meta())
    model.eval()
    y1 = torch.randint(0, 2, (b,)).float()
    y2 = torch.stack([torch.randint(1, 6, (b,)).float(), torch.randint(0, 2, (b,)).float()], 1)
    data = rd.TaskData(x, [y1, y2])
    splits = rd.Splits(data, data, data, _ml_meta())
    exp = ml.experiment()
    hp = {**ml.QUICK_HPARAMS["softmax"], "epochs": 1}
    metrics, _ = rd.train_one(exp, "softmax", hp, 0.1, 0, splits)
    expected = 0.1 * metrics["test_loss_task1"] + 0.9 * metrics["test_loss_task2"]
    assert metrics["test_loss"] == pytest.approx(expected)


# --------------------------------------------------------------------------------------------
# Table C.2
# --------------------------------------------------------------------------------------------


def test_table_c2_flops_hand_checked() -> None:
    # steps of batch 128, 128, 64 needing 8, 2 and 2 experts per example; F = 100 FLOPs
    assert training_expert_flops([8, 2, 2], [128, 128, 64], 100.0) == pytest.approx(
        3 * 100 * (8 * 128 + 2 * 128 + 2 * 64)
    )
    assert flops_ratio([2.0, 4.0], [3.0, 3.0]) == pytest.approx(1.0)
    assert math.isnan(flops_ratio([], [1.0]))
    # experts needed per example from the gate weights of a step
    mon = GateMonitor(torch.nn.Identity())
    static = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])  # union {0, 1}
    per_example = torch.tensor(
        [
            [[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]],  # {0, 1}
            [[0.0, 0.3, 0.7, 0.0], [1.0, 0.0, 0.0, 0.0]],  # {0, 1, 2}
        ]
    )
    x = torch.zeros(2, 3)
    batch = rd.TaskData(x, [torch.zeros(2)])
    mon.on_step(torch.nn.Identity(), batch, SimpleNamespace(gate_weights=static), History(steps=1))
    mon.on_step(
        torch.nn.Identity(), batch, SimpleNamespace(gate_weights=per_example), History(steps=2)
    )
    assert mon.needed_per_step == [2.0, 2.5]
    assert mon.needed_sum == pytest.approx(2 * 2.0 + 2 * 2.5)


def test_monitor_detects_binary_dselect_k() -> None:
    torch.manual_seed(0)
    model = ml.build_model("dselect_k_static", ml.QUICK_HPARAMS["dselect_k_static"], _ml_meta())
    mon = GateMonitor(model, check_every=1)
    x = torch.zeros(2, 24, dtype=torch.int64)
    assert mon.binary_fraction(x) == 0.0
    gate = mon.gates[0]
    with torch.no_grad():
        gate.logits[..., gate.k :] = 5.0  # |z| >= γ/2: S(z) = 1 exactly
    assert mon.binary_fraction(x) == 1.0


# --------------------------------------------------------------------------------------------
# end to end
# --------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny fixtures above are not the published files: use them as they are (the CLI has
    no verify flag; the data loaders read $DSELECTK_VERIFY)."""
    monkeypatch.setenv(VERIFY_ENV_VAR, "0")


_UNVERIFIED = pytest.mark.filterwarnings("ignore:checksum verification:UserWarning")


def _tiny_movielens_argv(
    data: Path, out: Path, gates: list[str], reps: int, *extra: str
) -> list[str]:
    """``dselectk reproduce movielens`` on the tiny ML-100K files: α = 0.5, one epoch."""
    return [
        "reproduce", "movielens", "--variant", "ml-100k", "--data-dir", str(data),
        "--out", str(out), "--alphas", "0.5", "--gates", *gates, "--epochs", "1",
        "--repetitions", str(reps), "--no-progress", *extra,
    ]  # fmt: skip


def _runs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]


@_UNVERIFIED
@pytest.mark.usefixtures("tiny_files")
def test_tiny_movielens_sweep_end_to_end(tmp_path: Path) -> None:
    write_ml100k(tmp_path / "data")
    out = tmp_path / "res"
    gates = ["dselect_k_static", "topk_static", "shared_bottom"]
    assert main(_tiny_movielens_argv(tmp_path / "data", out, gates, reps=2)) == 0
    recs = _runs(out)
    assert len(recs) == 6
    assert {r["config"]["experiment"] for r in recs} == {"movielens"}
    assert all(r["config"]["alpha"] == 0.5 for r in recs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiment"] == "movielens" and summary["records"] == 6
    assert "MovieLens α=0.5/static" in summary["table_c2"]
    report = (out / "report.md").read_text()
    assert "Table 1" in report and "Table C.3" in report and "Table C.2" in report
    assert "4015 ± 5" not in report  # α = 0.1 not run: its paper row is not shown
    assert "3804 ± 3" in report  # the paper's static DSelect-k loss at α = 0.5
    assert "Non-neural: item popularity" in report and "Constant predictor" in report
    assert all(r["config"]["init"] == "keras" for r in recs)
    assert all(r["config"]["optimizer_defaults"] == "tf" for r in recs)
    assert len(list(out.glob("reference_*.json"))) == 1  # cached once per data configuration
    assert (out / "plots" / "heatmap_dselect_k_static_alpha0.5.png").is_file()
    assert (out / "plots" / "trajectory_dselect_k_static_alpha0.5.png").is_file()
    # the report is rebuilt from the records alone
    (out / "report.md").unlink()
    ml.write_report(out)
    assert (out / "report.md").read_text() == report
    (out / "report.md").unlink()
    assert main(["report", str(out)]) == 0  # `dselectk report DIR` finds the module
    assert (out / "report.md").read_text() == report


@_UNVERIFIED
@pytest.mark.usefixtures("tiny_files")
def test_movielens_telemetry_logs_every_run(tmp_path: Path) -> None:
    write_ml100k(tmp_path / "data")
    out = tmp_path / "res"
    gates = ["dselect_k_static", "topk_per_example"]
    assert main(_tiny_movielens_argv(tmp_path / "data", out, gates, 1, "--telemetry")) == 0
    runs = sorted(p.name for p in (out / "telemetry").iterdir())
    assert runs == ["dselect_k_static-alpha=0.5-rep0", "topk_per_example-alpha=0.5-rep0"]
    for name in runs:  # TensorBoard event files (the extra is installed) or routing.jsonl
        files = [p for p in (out / "telemetry" / name).rglob("*") if p.is_file()]
        assert files and all(p.stat().st_size > 0 for p in files), name
    # telemetry does not change the runs: the same records without it
    plain = tmp_path / "plain"
    assert main(_tiny_movielens_argv(tmp_path / "data", plain, gates, 1)) == 0
    for a, b in zip(_runs(out), _runs(plain)):
        assert a["config"] == b["config"]
        for k in ("test_loss", "val_loss", "selected_experts"):
            assert a["metrics"][k] == b["metrics"][k], k


@_UNVERIFIED
@pytest.mark.usefixtures("tiny_files")
def test_tiny_multi_fashion_sweep_and_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_mnist(tmp_path / "data", "fashion-mnist")
    out = tmp_path / "res"
    argv = [
        "reproduce", "multi-fashion", "--data-dir", str(tmp_path / "data"), "--out", str(out),
        "--gates", "dselect_k_static", "topk_static", "softmax", "--epochs", "1",
        "--repetitions", "2", "--n-train", "64", "--n-val", "16", "--n-test", "16",
        "--no-progress",
    ]  # fmt: skip
    real = rd_recipe.train_one  # what a cell of the sweep calls
    calls: list[str] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated interruption")
        return real(*args, **kwargs)

    monkeypatch.setattr(rd_recipe, "train_one", failing)
    assert main(argv) == 130  # one line on stderr, no traceback: rerun to resume
    first = _runs(out)
    assert len(first) == 2  # complete records only
    assert not list((out / "runs").glob("*.tmp"))
    ids = {r["run_id"] for r in first}

    calls.clear()

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(rd_recipe, "train_one", counting)
    assert main(argv) == 0
    assert len(calls) == 4  # 6 runs, 2 already done
    recs = _runs(out)
    assert len(recs) == 6 and ids <= {r["run_id"] for r in recs}
    assert {r["config"]["experiment"] for r in recs} == {"multi-fashion"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiment"] == "multi-fashion"
    report = (out / "report.md").read_text()
    assert "Multi-Fashion-MNIST" in report and "83.78 ± 0.05" in report
    assert "examples/s" in report
    assert (out / "plots" / "heatmap_softmax.png").is_file()
    # a third run changes nothing
    calls.clear()
    assert main(argv) == 0
    assert calls == []
    acc = recs[0]["metrics"]["test_accuracy_task1"]
    assert 0.0 <= acc <= 1.0


@_UNVERIFIED
@pytest.mark.usefixtures("tiny_files")
def test_full_mode_tunes_then_trains(tmp_path: Path) -> None:
    write_ml100k(tmp_path / "data")
    out = tmp_path / "res"
    argv = [
        "reproduce", "movielens", "--full", "--variant", "ml-100k",
        "--data-dir", str(tmp_path / "data"), "--out", str(out), "--alphas", "0.9",
        "--gates", "dselect_k_static", "gumbel_softmax", "--epochs", "1", "--repetitions", "1",
        "--grid-points", "2", "--trials", "1", "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    recs = _runs(out)
    phases = sorted(r["config"]["phase"] for r in recs)
    assert phases.count("tune") == 4 and phases.count("final") == 2
    selected = json.loads((out / "selected_hparams.json").read_text())
    hp = selected["dselect_k_static/alpha=0.9"]["hparams"]
    assert hp["epochs"] == 1 and hp["k"] in (2, 4) and hp["lr"] in ml.GRID["topk_static"]["lr"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["records"] == 2 and summary["tune_records"] == 4


@_UNVERIFIED
@pytest.mark.usefixtures("tiny_files")
def test_dry_run_prints_the_plan_and_trains_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_ml100k(tmp_path / "data")
    out = tmp_path / "res"
    gates = ["dselect_k_per_example", "shared_bottom"]
    assert main(_tiny_movielens_argv(tmp_path / "data", out, gates, 2, "--dry-run")) == 0
    text = capsys.readouterr().out
    assert "Plan of `movielens` (quick" in text and "Per-example DSelect-k" in text
    assert "| Shared Bottom | 0 × 7 | 2 × 7 |" in text  # 800 examples: 7 steps of 128
    assert not list(out.glob("runs/*.json"))
