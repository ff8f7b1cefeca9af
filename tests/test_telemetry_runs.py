"""Telemetry of several runs in one folder stays apart: a run id in every record (issue 24)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dselectk.gates import DSelectK
from dselectk.layers import StackedMLP
from dselectk.models import MultiGateMoE
from dselectk.telemetry import RoutingTelemetry, new_run_id, read_jsonl
from dselectk.training import TaskData, TrainConfig, train


def _tiny(seed: int) -> tuple[nn.Module, TaskData]:
    torch.manual_seed(seed)
    model = MultiGateMoE(
        StackedMLP(4, 6, [5], final_activation=True),
        DSelectK(4, 2, num_gates=2),
        StackedMLP(2, 5, [1], final_activation=False),
    )
    x = torch.randn(64, 6)
    return model, TaskData(x, [x[:, :1].clone(), x[:, 1:2].clone()])


def _cfg(epochs: int) -> TrainConfig:
    return TrainConfig(batch_size=16, epochs=epochs, progress=False)


def test_two_runs_into_one_folder_stay_apart(tmp_path: Path) -> None:
    """The issue: a second run appended its records to the first run's file, indistinguishable."""
    runs = []
    for seed, epochs in ((0, 2), (1, 3)):
        model, data = _tiny(seed)
        tel = RoutingTelemetry(tmp_path, every=4, backend="jsonl")
        train(model, data, "mse", _cfg(epochs), callbacks=[tel])
        runs.append(tel)
    first, second = runs
    assert first.run_id != second.run_id
    lines = [json.loads(s) for s in (tmp_path / "routing.jsonl").read_text().splitlines()]
    assert len(lines) == 2 + 3
    assert all(rec["run"] in (first.run_id, second.run_id) for rec in lines)  # every record
    grouped = read_jsonl(tmp_path / "routing.jsonl")
    assert list(grouped) == [first.run_id, second.run_id]
    assert [r["step"] for r in grouped[first.run_id]] == [4, 8]
    assert [r["step"] for r in grouped[second.run_id]] == [4, 8, 12]
    assert grouped[first.run_id] == json.loads(json.dumps(first.records))
    assert all(r["run"] == second.run_id for r in second.records)


def test_run_ids_unique_and_settable(tmp_path: Path) -> None:
    ids = {new_run_id() for _ in range(50)}
    assert len(ids) == 50
    tel = RoutingTelemetry(tmp_path, backend="jsonl", run_id="seed0-a")
    model, data = _tiny(0)
    assert tel.log(model, 1, batch=data)["run"] == "seed0-a"  # type: ignore[index]
    tel.close()
    (tmp_path / "routing.jsonl").open("a").write('{"step": 9, "gates": {}}\n')  # an old record
    assert {k: len(v) for k, v in read_jsonl(tmp_path / "routing.jsonl").items()} == {
        "seed0-a": 1,
        None: 1,
    }
    assert RoutingTelemetry(None).run_id  # in-memory records carry one too
    for bad in ("", " x", "a/b", 3):
        with pytest.raises(ValueError, match="run_id"):
            RoutingTelemetry(None, run_id=bad)  # type: ignore[arg-type]


def test_tensorboard_event_files_name_their_run(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    ids = []
    for seed in (0, 1):
        model, data = _tiny(seed)
        with RoutingTelemetry(tmp_path, every=4, backend="tensorboard") as tel:
            train(model, data, "mse", _cfg(1), callbacks=[tel])
        ids.append(tel.run_id)
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("events.out"))
    assert len(files) == 2
    assert sorted(next(i for i in ids if f.endswith("." + i)) for f in files) == sorted(ids)
