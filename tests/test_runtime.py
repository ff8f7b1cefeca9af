"""dselectk.runtime: the allocator setting is applied once and changes no numbers; workers
exit with their parent."""

from __future__ import annotations

import subprocess
import sys

import torch

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
