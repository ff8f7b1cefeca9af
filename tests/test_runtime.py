"""dselectk.runtime: the allocator setting is applied once and changes no numbers; workers
exit with their parent."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dselectk import runtime
from dselectk.runtime import tune_allocator


def test_tune_allocator_is_idempotent_and_reports_platform() -> None:
    first = tune_allocator()
    assert tune_allocator() is first
    if sys.platform.startswith("linux") and "glibc" in " ".join(__import__("platform").libc_ver()):
        assert first is True


def test_numbers_do_not_depend_on_the_allocator() -> None:
    code = (
        "import torch, dselectk\n"
        "dselectk.tune_allocator()\n"
        "torch.manual_seed(0)\n"
        "g = dselectk.DSelectK(64, 4, in_features=8, entropy_reg=0.1)\n"
        "x = torch.randn(4096, 8)\n"
        "o = g(x); (o.weights.square().sum() + o.aux_loss).backward()\n"
        "w = g.proj.weight.grad.double().sum()\n"
        "print(repr(float(o.weights.double().sum())), repr(float(w)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ref = subprocess.run(
        [sys.executable, "-c", code.replace("dselectk.tune_allocator()\n", "")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == ref.stdout
    assert torch.isfinite(torch.tensor([float(v) for v in out.stdout.split()])).all()


def test_exit_with_parent_exits_when_the_parent_is_not_the_expected_one() -> None:
    code = "import os\nfrom dselectk.runtime import exit_with_parent\n"
    ok = subprocess.run(
        [sys.executable, "-c", code + "exit_with_parent(os.getppid()); print('alive')"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "alive"
    gone = subprocess.run(
        [sys.executable, "-c", code + "exit_with_parent(os.getppid() + 1); print('alive')"],
        capture_output=True,
        text=True,
    )
    assert gone.returncode == 1 and "alive" not in gone.stdout


# ---------------------------------------------------------------- the thread policy


@pytest.fixture
def policy() -> Iterator[None]:
    """Restore the thread policy, the CPU quota and torch's count after a test."""
    before_setting = runtime.thread_policy_setting()
    before_threads = torch.get_num_threads()
    before_quota = runtime._cpu_quota
    try:
        yield
    finally:
        runtime.set_thread_policy(before_setting)
        runtime._cpu_quota = before_quota
        torch.set_num_threads(before_threads)


def test_policy_setting_parses_and_refuses_bad_values(policy: None) -> None:
    runtime.set_thread_policy("auto")
    assert runtime.set_thread_policy("torch") == "auto"
    assert runtime.thread_policy_setting() == "torch"
    assert runtime.set_thread_policy(" 3 ") == "torch"
    assert runtime.thread_policy_setting() == 3
    assert runtime.set_thread_policy("AUTO") == 3 and runtime.thread_policy_setting() == "auto"
    for bad in ("0", "two", "-1", 0, -2, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="thread policy"):
            runtime.set_thread_policy(bad)  # type: ignore[arg-type]
    assert runtime.thread_policy_setting() == "auto"  # a refused value changes nothing


def test_auto_policy_is_one_thread_below_the_work_threshold_else_the_cpu_quota(
    policy: None,
) -> None:
    runtime.set_thread_policy("auto")
    torch.set_num_threads(2)
    small, big = runtime.PARALLEL_MIN_WORK - 1, runtime.PARALLEL_MIN_WORK
    assert runtime.policy_threads(small) == 1
    runtime._cpu_quota = 8  # more CPUs than torch's count: torch's count stays (None)
    assert runtime.policy_threads(big) is None and runtime.policy_threads() is None
    runtime._cpu_quota = 1  # a quota of one CPU caps the pool
    assert runtime.policy_threads(big) == 1
    with runtime.thread_policy(big) as n:
        assert n == 1 == torch.get_num_threads()
    assert torch.get_num_threads() == 2
    runtime._cpu_quota = 8
    with runtime.thread_policy(small) as n:
        assert n == 1 == torch.get_num_threads()
    with runtime.thread_policy(big) as n:
        assert n == 2 == torch.get_num_threads()
    with pytest.raises(RuntimeError), runtime.thread_policy(small):
        raise RuntimeError
    assert torch.get_num_threads() == 2


def test_int_and_torch_policies_override_every_rule(policy: None) -> None:
    torch.set_num_threads(2)
    runtime._cpu_quota = 8
    runtime.set_thread_policy(3)
    assert runtime.policy_threads(1) == 3 and runtime.policy_threads(None) == 3
    with runtime.intra_op_threads(1, elements=10):  # the kernels' small problems: n as well
        assert torch.get_num_threads() == 3
    with runtime._OneThread():
        assert torch.get_num_threads() == 3
    assert torch.get_num_threads() == 2
    runtime.set_thread_policy("torch")
    assert runtime.policy_threads(1) is None
    with runtime.intra_op_threads(1, elements=10), runtime._OneThread(), runtime.thread_policy(1):
        assert torch.get_num_threads() == 2  # the package never changes torch's count
    with runtime.intra_op_threads(1):  # an explicit limit still holds
        assert torch.get_num_threads() == 1
    runtime.set_thread_policy("auto")
    with runtime._OneThread(), runtime.intra_op_threads(1, elements=10):
        assert torch.get_num_threads() == 1
    runtime._cpu_quota = 1  # large kernel problems: capped to the quota
    with runtime.intra_op_threads(1, elements=runtime.PARALLEL_MIN_ELEMENTS):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_train_threads_follows_the_policy(policy: None) -> None:
    from dselectk.training.config import TrainConfig, train_threads

    model = torch.nn.Linear(100, 100)  # 10100 parameters
    torch.set_num_threads(2)
    runtime._cpu_quota = 1
    big = TrainConfig(batch_size=runtime.PARALLEL_MIN_WORK // 10100 + 1)
    assert train_threads(TrainConfig(batch_size=32), model) == 1
    assert train_threads(big, model) == 1  # capped to the one CPU the process may use
    runtime._cpu_quota = 2
    assert train_threads(big, model) is None
    runtime.set_thread_policy("torch")
    assert train_threads(TrainConfig(batch_size=32), model) is None
    assert train_threads(TrainConfig(batch_size=32, threads=3), model) == 3  # explicit wins


def test_cpu_quota_is_within_the_affinity() -> None:
    runtime._cpu_quota = None
    n = runtime.cpu_quota()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= n <= (affinity or 1)
    quota = runtime._cgroup_cpus()
    if quota is not None:
        assert n <= max(1, math.ceil(quota))


def test_threads_env_is_read_at_import_and_checked() -> None:
    code = "from dselectk import runtime; print(runtime.thread_policy_setting())"
    env = dict(os.environ, DSELECTK_THREADS="torch")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "torch"
    env["DSELECTK_THREADS"] = "4"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "4"
    env["DSELECTK_THREADS"] = "many"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "DSELECTK_THREADS" in out.stderr and "ValueError" in out.stderr


def test_cgroup_quota_is_read_from_v2_and_v1_files(tmp_path: Path) -> None:
    def write(path: Path, text: str) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return str(path)

    root = tmp_path / "fs"
    v2 = write(tmp_path / "v2", "0::/box/job\n")
    write(root / "box/job/cpu.max", "150000 100000\n")
    assert runtime._cgroup_cpus(v2, str(root)) == 1.5
    write(root / "box/job/cpu.max", "max 100000\n")
    assert runtime._cgroup_cpus(v2, str(root)) is None
    v2_root = write(tmp_path / "v2root", "0::/\n")
    write(root / "cpu.max", "50000 100000\n")
    assert runtime._cgroup_cpus(v2_root, str(root)) == 0.5
    v1 = write(tmp_path / "v1", "5:memory:/x\n4:cpu,cpuacct:/docker/c1\n")
    write(root / "cpu,cpuacct/docker/c1/cpu.cfs_quota_us", "300000\n")
    write(root / "cpu,cpuacct/docker/c1/cpu.cfs_period_us", "100000\n")
    assert runtime._cgroup_cpus(v1, str(root)) == 3.0
    write(root / "cpu,cpuacct/docker/c1/cpu.cfs_quota_us", "-1\n")
    assert runtime._cgroup_cpus(v1, str(root)) is None
    assert runtime._cgroup_cpus(str(tmp_path / "missing"), str(root)) is None
    write(root / "box/job/cpu.max", "lots 100000\n")
    assert runtime._cgroup_cpus(v2, str(root)) is None  # unreadable: no quota assumed


def test_cpu_quota_rounds_a_fractional_quota_up_and_caps_the_affinity(
    policy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    for quota, cpus in ((None, 4), (1.5, 2), (0.2, 1), (16.0, 4)):
        monkeypatch.setattr(runtime, "_cgroup_cpus", lambda q=quota: q)
        runtime._cpu_quota = None
        assert runtime.cpu_quota() == cpus
