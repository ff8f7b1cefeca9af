"""``--executor slurm`` against a real Slurm (``scripts/local-slurm.sh start``).

A tiny recovery sweep (2 gates = 2 cells = 2 jobs, 1 run each): the same records as the local
executor, a job killed with scancel then the rerun resubmits exactly its cell, a job that raises
is reported by cell and the other lands, and the driver detaches on Ctrl-C and re-attaches.

Skipped when Slurm does not answer, unless ``DSELECTK_REQUIRE_SLURM=1`` (CI), then failed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dselectk._testing import PAUSE_ENV
from dselectk.cli import main
from dselectk_research.slurm import JOBS_FILE, squeue_states

pytestmark = pytest.mark.slurm

COMMON = [
    "reproduce",
    "recovery",
    "--reps",
    "1",
    "--epochs",
    "1",
    "--lrs",
    "0.1",
    "--gates",
    "dselect_k",
    "topk",
    "--no-progress",
    "--record-every",
    "5",
    "--threads",
    "1",
    "--jobs",
    "1",
]
SLURM = ["--executor", "slurm", "--slurm-time", "10"]


def _slurm_problem() -> str | None:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "Slurm is not installed (no sinfo/sbatch); run scripts/local-slurm.sh start"
    try:
        import submitit  # noqa: F401
    except ImportError:
        return "submitit is not installed (pip install 'dselectk[cluster]')"
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    states = proc.stdout.split()
    if proc.returncode != 0 or not any(s.startswith(("idle", "mix", "alloc")) for s in states):
        return (
            f"Slurm does not answer or has no usable node (sinfo: {proc.stderr.strip() or states})"
        )
    return None


@pytest.fixture(scope="module", autouse=True)
def slurm_up() -> None:
    problem = _slurm_problem()
    if problem is None:
        return
    if os.environ.get("DSELECTK_REQUIRE_SLURM") == "1":
        pytest.fail(f"DSELECTK_REQUIRE_SLURM=1 but {problem}")
    pytest.skip(problem)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("local")
    assert main([*COMMON, "--out", str(out)]) == 0
    return _results(out)


def _results(out: Path) -> dict[str, Any]:
    records = {p.stem: json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))}
    return {
        "records": records,
        "plan": json.loads((out / "plan.json").read_text())["runs"],
        "selected": json.loads((out / "selected_hparams.json").read_text()),
    }


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got["records"]) == sorted(want["records"])
    for rid, rec in want["records"].items():
        assert got["records"][rid]["config"] == rec["config"]
        for k, v in rec["metrics"].items():
            if isinstance(v, float):
                assert got["records"][rid]["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6)
            else:
                assert got["records"][rid]["metrics"][k] == v, k
    assert got["plan"] == want["plan"] and got["selected"] == want["selected"]


def _book(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / JOBS_FILE).read_text())["jobs"]


def _wait_gone(job_ids: list[str], timeout: float = 60) -> None:
    end = time.time() + timeout
    while squeue_states(job_ids) and time.time() < end:
        time.sleep(0.5)
    assert not squeue_states(job_ids), f"jobs {job_ids} still queued after {timeout}s"


def test_slurm_gives_the_local_records(local_run: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "slurm"
    assert main([*COMMON, "--out", str(out), *SLURM]) == 0
    _assert_same(_results(out), local_run)
    assert [e["cell"] for e in _book(out)] == ["dselect_k", "topk"]
    assert all("result" in e for e in _book(out))
    # rerun: complete, nothing submitted, the same selections and plan
    assert main([*COMMON, "--out", str(out), *SLURM]) == 0
    assert len(_book(out)) == 2
    _assert_same(_results(out), local_run)


def test_scancel_and_failing_job_then_rerun(
    local_run: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "faults"
    # topk's only run cannot be written (a directory where its record goes): that job raises
    rids = {rec["config"]["gate"]: r for r, rec in local_run["records"].items()}
    topk_rid = rids["topk"]
    (out / "runs" / f"{topk_rid}.json").mkdir(parents=True)
    # The jobs pause inside their record write, before the rename (dselectk._testing), so the
    # scancel certainly lands before dselect_k's record exists, however fast the job is.
    barrier = tmp_path / "barrier"
    monkeypatch.setenv(PAUSE_ENV, f"before-replace/runs@1@{barrier}")
    with pytest.raises(SystemExit) as exc:
        main([*COMMON, "--out", str(out), *SLURM, "--slurm-no-wait"])
    assert exc.value.code == 0
    monkeypatch.delenv(PAUSE_ENV)
    first = _book(out)
    assert [e["cell"] for e in first] == ["dselect_k", "topk"]
    end = time.time() + 300  # bounds a broken test only
    while not list((out / "runs").glob(f".{rids['dselect_k']}.json.*.tmp")):
        assert time.time() < end, "the dselect_k job never started its record"
        time.sleep(0.2)
    subprocess.run(["scancel", first[0]["job_id"]], check=True)  # killed before its record
    _wait_gone([first[0]["job_id"]])
    # The topk job goes on (and fails) only once the rerun below has re-attached to it: were it
    # to end before the rerun's squeue, the rerun would find its error as a finished job's and
    # resubmit it (the cell failed while no command watched), not report it.
    release = threading.Timer(3.0, Path(f"{barrier}.release").touch)
    release.start()
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exc:
            main([*COMMON, "--out", str(out), *SLURM])
    finally:
        release.join()
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "1 of 2 cells failed" in err and "topk: job" in err and "IsADirectoryError" in err
    book = _book(out)
    assert [e["cell"] for e in book[2:]] == ["dselect_k"]  # exactly the cancelled cell again
    assert "without a result" in book[0]["error"] and "IsADirectoryError" in book[1]["error"]
    assert set(_results_records(out)) == set(local_run["records"]) - {topk_rid}
    (out / "runs" / f"{topk_rid}.json").rmdir()
    assert main([*COMMON, "--out", str(out), *SLURM]) == 0
    assert [e["cell"] for e in _book(out)[3:]] == ["topk"]  # exactly the failed cell again
    _assert_same(_results(out), local_run)


def _results_records(out: Path) -> list[str]:
    return [p.stem for p in (out / "runs").glob("*.json") if p.is_file()]


def test_detach_with_ctrl_c_and_reattach(
    local_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "detach"
    exe = Path(sys.executable).with_name("dselectk")
    # Each job pauses right after its record (dselectk._testing), so the jobs are certainly
    # still running when the driver is interrupted, however loaded the machine is.
    barrier = tmp_path / "barrier"
    env = {**os.environ, PAUSE_ENV: f"record-saved@1@{barrier}"}
    driver = subprocess.Popen(
        [str(exe), *COMMON, "--out", str(out), *SLURM],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # a shell that runs the suite in the background starts it with SIGINT ignored, and
        # children inherit that: give the driver the default disposition, as in a terminal
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    end = time.time() + 300  # bounds a broken test only
    while not barrier.is_file():
        assert driver.poll() is None, "the driver ended before a job reached its pause point"
        assert time.time() < end, "no job reached its pause point"
        time.sleep(0.2)
    driver.send_signal(signal.SIGINT)
    _, err = driver.communicate(timeout=30)
    assert driver.returncode == 130, err
    assert "detached" in err and "re-attach" in err
    ids = [e["job_id"] for e in _book(out)]
    assert len(ids) == 2 and squeue_states(ids), "the jobs should outlive the driver"
    # the report reads records only: it works while the jobs run (a record is in: the barrier)
    assert _results_records(out)
    assert main(["report", str(out)]) == 0
    capsys.readouterr()
    Path(f"{barrier}.release").touch()  # let the paused jobs finish
    assert main([*COMMON, "--out", str(out), *SLURM]) == 0  # re-attach: nothing new submitted
    assert [e["job_id"] for e in _book(out)] == ids
    _assert_same(_results(out), local_run)
