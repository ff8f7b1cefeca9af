"""The Slurm executor's logic without Slurm: a fake submitit executor and a fake squeue.

The fake executor queues the jobs (ids ``<array>_<i>``, like Slurm's array tasks); the test
decides which ones run (writing the submitit result pickle as a real job would), which are
killed (gone from the queue without a result) and which stay queued.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dselectk_research import slurm as E
from dselectk_research.args import config_from_args
from dselectk_research.executors import LocalExecutor
from dselectk_research.records import RunStore
from dselectk_research.runner import Recipe, executor_from_args, run_sweep
from dselectk_research.slurm import SlurmExecutor, add_executor_arguments

_FAIL_CELL = -1  #: the cell whose runs raise (a bug that a later code change fixes)


# -- a tiny sweep: cell c writes records (c, rep) for rep < args.reps ----------------------------
def _run_cell(args: Any, cell: int, data: Any, progress: bool, store: RunStore) -> dict[str, Any]:
    for rep in range(args.reps):
        cfg = {"cell": cell, "rep": rep, "reps": args.reps}
        if store.done(cfg):
            continue
        if cell == _FAIL_CELL:
            raise RuntimeError(f"cell {cell} exploded")
        store.save(cfg, {"m": cell * 10 + rep + data})
    return {"lr": 0.1 * (cell + 1)}


def _load(args: Any) -> int:
    return 1


@dataclass(frozen=True)
class _Config:
    out: Path
    reps: int


def _cfg(args: argparse.Namespace) -> _Config:
    return config_from_args(_Config, args)


def _sweep() -> Recipe:
    return Recipe(
        cells=[0, 1, 2],
        run_cell=_run_cell,
        load_data=_load,
        data_key=lambda a: 0,
        cell_name=lambda c: f"cell{c}",
    )


class _Job:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id


class FakeCluster:
    """A fake submitit executor + squeue: jobs stay queued until :meth:`run` or :meth:`kill`."""

    def __init__(self) -> None:
        self.arrays = 0
        self.queue: dict[str, tuple[Any, tuple[Any, ...]]] = {}
        self.folder: Path | None = None
        self.submitted: list[list[str]] = []
        self.auto_run = False

    def make_executor(self, folder: Path, opts: E.SlurmOptions) -> FakeCluster:
        self.folder = folder
        return self

    def map_array(self, fn: Any, *iterables: Iterable[Any]) -> list[_Job]:
        self.arrays += 1
        jobs = []
        for i, call_args in enumerate(zip(*iterables)):
            jid = f"{self.arrays}_{i}"
            self.queue[jid] = (fn, call_args)
            jobs.append(_Job(jid))
        self.submitted.append([j.job_id for j in jobs])
        return jobs

    def run(self, jid: str) -> None:
        fn, call_args = self.queue.pop(jid)
        try:
            result: tuple[str, Any] = ("success", fn(*call_args))
        except Exception as e:  # as submitit does: the job's result is the traceback
            result = ("error", f"Traceback ...\n{type(e).__name__}: {e}")
        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / f"{jid}_0_result.pkl").open("wb") as f:
            pickle.dump(result, f)

    def kill(self, jid: str) -> None:
        self.queue.pop(jid)

    def states(self, ids: Iterable[str]) -> dict[str, str]:
        if self.auto_run:
            for jid in [j for j in ids if j in self.queue]:
                self.run(jid)
        return {j: "RUNNING" for j in ids if j in self.queue}


def _args(out: Path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--reps", type=int, default=2)
    add_executor_arguments(p)
    return p.parse_args(["--out", str(out), "--executor", "slurm", *extra])


def _drive(
    cluster: FakeCluster, args: argparse.Namespace, **kw: Any
) -> tuple[dict[str, Any], set[str]]:
    opts = E.slurm_options(args)
    assert opts is not None
    opts = E.SlurmOptions(**{**opts.__dict__, "poll_s": 0.0})
    selected: dict[str, Any] = {}
    runs: set[str] = set()

    def on_cell(name: str, selection: dict[str, Any], cell_runs: list[str]) -> None:
        selected[name] = selection
        runs.update(cell_runs)

    E.run_slurm(
        _sweep(),
        _cfg(args),
        args.out,
        opts,
        progress=False,
        on_cell=on_cell,
        make_executor=cluster.make_executor,
        states=cluster.states,
        log=lambda msg: None,
        **kw,
    )
    return selected, runs


def _book(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / E.JOBS_FILE).read_text())["jobs"]


def test_flags() -> None:
    args = _args(
        Path("x"),
        "--slurm-partition",
        "gpu",
        "--slurm-time",
        "30",
        "--slurm-gpus",
        "1",
        "--slurm-opt",
        "account=abc",
        "--slurm-opt",
        "qos=low",
    )
    opts = E.slurm_options(args)
    assert opts == E.SlurmOptions(
        partition="gpu", time_min=30, gpus=1, extra={"account": "abc", "qos": "low"}
    )
    assert E.slurm_options(argparse.Namespace(executor="local")) is None
    assert executor_from_args(args) == SlurmExecutor(opts)
    local = executor_from_args(argparse.Namespace(executor="local", jobs=0), threads=1)
    assert local == LocalExecutor(jobs=0, threads=1) and local.sized(3).jobs >= 1
    with pytest.raises(SystemExit):
        _args(Path("x"), "--slurm-opt", "novalue")
    with pytest.raises(SystemExit):
        _args(Path("x"), "--slurm-time", "0")
    # where the cells run does not change which jobs count as this sweep's
    key = E.sweep_key(_cfg(args))
    assert key == E.sweep_key(_cfg(_args(Path("x"), "--slurm-cpus", "4")))
    assert key != E.sweep_key(_cfg(_args(Path("x"), "--reps", "3")))


def test_detach_kill_and_resubmit_exactly_the_missing_cells(tmp_path: Path) -> None:
    cluster = FakeCluster()
    args = _args(tmp_path, "--slurm-no-wait")
    with pytest.raises(E.SweepDetached) as exc:
        _drive(cluster, args)
    assert exc.value.code == 0
    assert cluster.submitted == [["1_0", "1_1", "1_2"]]
    assert [(e["job_id"], e["cell"]) for e in _book(tmp_path)] == [
        ("1_0", "cell0"),
        ("1_1", "cell1"),
        ("1_2", "cell2"),
    ]
    cluster.run("1_0")  # finished while detached
    cluster.kill("1_1")  # scancel / preempted: no result
    # 1_2 still queued: re-attach to it, resubmit cell1 only
    cluster.auto_run = True
    selected, runs = _drive(cluster, _args(tmp_path))
    assert cluster.submitted[1:] == [["2_0"]]
    book = _book(tmp_path)
    assert [(e["job_id"], e["cell"]) for e in book][-1] == ("2_0", "cell1")
    assert "error" in book[1] and "without a result" in book[1]["error"]
    assert selected == {f"cell{c}": {"lr": pytest.approx(0.1 * (c + 1))} for c in range(3)}
    records = RunStore(tmp_path).load()
    assert len(records) == 6 and runs == {r["run_id"] for r in records}
    # everything done: nothing is submitted, selections and run ids come from the book
    again, runs2 = _drive(cluster, _args(tmp_path))
    assert len(cluster.submitted) == 2 and again == selected and runs2 == runs


def test_lost_record_or_other_settings_resubmit(tmp_path: Path) -> None:
    cluster = FakeCluster()
    cluster.auto_run = True
    _drive(cluster, _args(tmp_path))
    assert len(cluster.submitted) == 1
    victim = sorted((tmp_path / "runs").glob("*.json"))[0]
    cell = json.loads(victim.read_text())["config"]["cell"]
    victim.unlink()
    _drive(cluster, _args(tmp_path))
    assert cluster.submitted[-1] == ["2_0"] and _book(tmp_path)[-1]["cell"] == f"cell{cell}"
    _drive(cluster, _args(tmp_path, "--reps", "3"))  # other settings: every cell is new
    assert len(cluster.submitted[-1]) == 3
    assert len(RunStore(tmp_path).load()) == 6 + 9  # the config holds reps: all new runs


def test_failed_job_is_reported_and_the_others_land(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = FakeCluster()
    cluster.auto_run = True
    monkeypatch.setattr(sys.modules[__name__], "_FAIL_CELL", 1)
    with pytest.raises(E.SweepFailed) as exc:
        _drive(cluster, _args(tmp_path))
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "1 of 3 cells failed" in err and "cell1: job 1_1: RuntimeError: cell 1 exploded" in err
    assert len(RunStore(tmp_path).load()) == 4  # cells 0 and 2
    monkeypatch.undo()
    _drive(cluster, _args(tmp_path))  # fixed: only the failed cell goes out again
    assert cluster.submitted[-1] == ["2_0"] and len(RunStore(tmp_path).load()) == 6


def test_run_sweep_slurm_writes_selections_and_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = FakeCluster()
    cluster.auto_run = True
    monkeypatch.setattr(E, "_make_slurm_executor", cluster.make_executor)
    monkeypatch.setattr(E, "squeue_states", cluster.states)
    args = _args(tmp_path)
    args.no_progress = True
    sel = run_sweep(_sweep(), _cfg(args), tmp_path, executor_from_args(args), command="x")
    local_out = tmp_path / "local"
    local_args = _args(local_out)
    local_args.executor = "local"
    local_args.no_progress = True
    local = executor_from_args(local_args)
    assert run_sweep(_sweep(), _cfg(local_args), local_out, local, command="x") == sel
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["runs"] == json.loads((local_out / "plan.json").read_text())["runs"]
    assert json.loads((tmp_path / "selected_hparams.json").read_text()) == sel


def test_a_job_ending_as_a_rerun_starts_is_waited_on_and_reported_not_resubmitted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job that squeue lists as running when a command re-attaches is waited on, even if it
    ends (here, fails) between squeue's answer and the look for its result file: its failure is
    reported, as any failure seen while waiting, and not resubmitted unseen."""
    cluster = FakeCluster()
    with pytest.raises(E.SweepDetached):
        _drive(cluster, _args(tmp_path, "--slurm-no-wait"))
    _, call_args = cluster.queue["1_1"]

    def fails(*_: Any) -> None:
        raise ZeroDivisionError("cell1 failed")

    cluster.queue["1_1"] = (fails, call_args)

    def racing(ids: Iterable[str]) -> dict[str, str]:
        asked = [j for j in ids if j in cluster.queue]
        for jid in asked:  # every job ends right after squeue answered "RUNNING"
            cluster.run(jid)
        return {j: "RUNNING" for j in asked}

    cluster.states = racing  # type: ignore[method-assign]
    with pytest.raises(E.SweepFailed) as exc:
        _drive(cluster, _args(tmp_path))
    assert exc.value.code == 1
    assert cluster.submitted == [["1_0", "1_1", "1_2"]]  # nothing resubmitted
    err = capsys.readouterr().err
    assert "1 of 3 cells failed" in err and "cell1: job 1_1" in err and "ZeroDivisionError" in err
    book = _book(tmp_path)
    assert "ZeroDivisionError" in book[1]["error"] and "result" in book[0] and "result" in book[2]
