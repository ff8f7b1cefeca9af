"""Run records: atomic writes, stable ids, summaries."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from dselectk.io import write_json
from dselectk_research.records import (
    RunStore,
    mean_se,
    run_id,
    summarize,
)
from dselectk_research.templates import Column, format_mean_se, markdown_table, screen_table


def test_run_id_is_stable_and_order_free() -> None:
    assert run_id({"a": 1, "b": [1, 2]}) == run_id({"b": [1, 2], "a": 1})
    assert run_id({"a": 1}) != run_id({"a": 2})


def test_store_round_trip_and_done(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    cfg = {"gate": "dselect_k", "rep": 0}
    assert not store.done(cfg)
    store.save(cfg, {"mse": 0.5, "bad": math.nan})
    assert store.done(cfg)
    (rec,) = store.load()
    assert rec["config"] == cfg and rec["metrics"] == {"mse": 0.5, "bad": None}
    assert "torch" in rec["environment"]
    assert not list(tmp_path.rglob("*.tmp"))


def test_unreadable_record_names_the_file(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.runs.mkdir(parents=True)
    (store.runs / "broken.json").write_text("{")
    with pytest.raises(ValueError, match=r"broken\.json"):
        store.load()


def test_atomic_write_leaves_old_file_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    write_json(path, {"ok": 1})
    with pytest.raises(TypeError):
        write_json(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"ok": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_mean_se_summarize_and_format() -> None:
    stats = mean_se([1.0, 2.0, 3.0, math.nan])
    assert stats["n"] == 3 and stats["mean"] == 2.0
    assert stats["se"] == pytest.approx(1 / math.sqrt(3))
    records = [
        {"config": {"gate": g, "rep": r}, "metrics": {"mse": v}}
        for g, r, v in [("a", 0, 1.0), ("a", 1, 3.0), ("b", 0, 5.0)]
    ]
    rows = summarize(records, ["gate"])
    assert [r["gate"] for r in rows] == ["a", "b"]
    assert rows[0]["metrics"]["mse"]["mean"] == 2.0 and rows[1]["metrics"]["mse"]["n"] == 1
    assert format_mean_se(rows[0]["metrics"]["mse"]) == "2.00 ± 1.00"
    assert format_mean_se(rows[1]["metrics"]["mse"], 1) == "5.0"
    assert format_mean_se(rows[1]["metrics"]["mse"], 0, show_n=True) == "5 (n=1)"
    assert format_mean_se(None) == "–"
    assert format_mean_se({"mean": 0.25, "se": 0.01, "n": 2}, 0, scale=1e4) == "2500 ± 100"


def test_one_column_list_renders_the_markdown_and_the_screen_table() -> None:
    rows = [
        {"label": "a gate", "metrics": {"mse": {"mean": 2.0, "se": 1.0, "n": 2}}},
        {"label": "b", "metrics": {}},
    ]
    columns = [
        Column("gate", value=lambda r: r["label"]),
        Column("test MSE", "mse", 3, screen="MSE"),
        Column("runs", value=lambda r: r["metrics"].get("mse", {}).get("n", 0), screen=None),
    ]
    assert markdown_table(columns, rows) == [
        "| gate | test MSE | runs |",
        "|---|---|---|",
        "| a gate | 2.000 ± 1.000 | 2 |",
        "| b | – | 0 |",
    ]
    assert markdown_table(columns, []) == ["| gate | test MSE | runs |", "|---|---|---|"]
    assert screen_table(columns, rows) == [  # as wide as the widest cell; no "runs"
        "gate              MSE",
        "---------------------",
        "a gate  2.000 ± 1.000",
        "b                   –",
    ]


def test_environment_runs_git_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    from dselectk_research import records

    calls: list[list[str]] = []
    real_run = subprocess.run

    def counting_run(cmd, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(list(cmd))
        return real_run(cmd, *args, **kwargs)

    records._static_environment.cache_clear()
    monkeypatch.setattr(records.subprocess, "run", counting_run)
    try:
        store = RunStore(tmp_path)
        for rep in range(3):
            store.save({"rep": rep}, {"mse": 0.1})
        envs = [r["environment"] for r in store.load()]
    finally:
        records._static_environment.cache_clear()
    assert len(calls) == 1 and calls[0][:2] == ["git", "rev-parse"]
    assert envs[0] == envs[1] == envs[2]
    assert sorted(envs[0]) == sorted(
        [
            *("dselectk", "git_commit", "torch", "python", "machine", "processor", "threads"),
            *("cuda", "kernel", "extras"),
        ]
    )


def test_stale_temps_of_dead_local_writers_are_removed_other_hosts_kept(tmp_path: Path) -> None:
    """A kill -9 mid-write leaves a temp file; the next RunStore removes it only if its writer
    ran on this host and is gone (on a shared filesystem another node's pid means nothing)."""
    import subprocess
    import sys

    from dselectk import io as _io
    from dselectk_research.records import RunStore

    runs = tmp_path / "runs"
    runs.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    mine = runs / f".a.json.{_io.HOST}-{dead}.xyz.tmp"
    alive = runs / f".b.json.{_io.HOST}-{os.getpid()}.xyz.tmp"
    other = runs / f".c.json.other_host-{dead}.xyz.tmp"
    for p in (mine, alive, other):
        p.write_text("{")
    RunStore(tmp_path)
    assert not mine.exists() and alive.exists() and other.exists()


@pytest.mark.parametrize("kernel", ["numpy", "aten", "numba"])
def test_records_name_the_kernel_and_extras_that_produced_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    import importlib.util

    from dselectk_research.records import EXTRAS, produced_by
    from dselectk_research.templates import environment_line

    monkeypatch.setenv("DSELECTK_KERNEL", kernel)
    store = RunStore(tmp_path)
    rec = json.loads(store.save({"rep": 0}, {"m": 1.0}).read_text())
    env = rec["environment"]
    assert env["kernel"] == kernel
    assert set(env["extras"]) == set(EXTRAS) == {"numba", "tqdm"}
    has_numba = importlib.util.find_spec("numba") is not None
    assert (env["extras"]["numba"] is not None) == has_numba
    monkeypatch.setenv("DSELECTK_KERNEL", "auto")
    auto = json.loads(store.save({"rep": 1}, {"m": 1.0}).read_text())["environment"]["kernel"]
    assert auto == ("numba" if has_numba else "numpy")
    old = {"config": {}, "metrics": {}, "environment": {"torch": "2"}}  # written before
    got = produced_by([rec, old])
    assert got["kernels"] == sorted([kernel, "not recorded"])
    assert "not recorded" in got["extras"]["tqdm"]
    line = environment_line(produced_by([rec]))
    assert line.startswith(f"DSelect-k CPU kernel (DSELECTK_KERNEL): {kernel}; extras: numba ")
    assert "tqdm" in line and environment_line(None) == "Kernel and extras: not recorded"
