"""numba's on-disk cache that cannot be written never breaks a computation.

A read-only install run by a user without a writable home (a container user such as
``nobody``): numba refuses to define a function with ``cache=True`` when no cache folder is
writable ("cannot cache function ..."), and a cache folder that fails while numba writes the
compiled code raises ``OSError`` from the first call. Either way the DSelect-k gate computes,
on the numba kernel compiled in memory, with one ``RuntimeWarning`` naming ``NUMBA_CACHE_DIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import dselectk
from dselectk.gates import DSelectK
from dselectk.kernels import numba_nodes, setting

_CHILD = r"""
import json, sys, warnings
import torch
import dselectk
from dselectk.gates import DSelectK
from dselectk.kernels import dispatch, setting

torch.manual_seed(0)
gate = DSelectK(8, 2, in_features=4, entropy_reg=0.1)
x = torch.randn(5, 4)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    node = dispatch.choose(5 * 2 * 8, x, gate._gamma, gate._entropy_reg, linear=True)
    with torch.no_grad():
        got = gate(x)
        again = gate(torch.randn(3, 4))  # a second call: no second warning
with warnings.catch_warnings():
    warnings.simplefilter("error")
    import os
    os.environ["DSELECTK_KERNEL"] = "numpy"
    with torch.no_grad():
        want = gate(x)
json.dump({
    "package": dselectk.__file__,
    "node": node.__name__,
    "cache": setting._load_numba(None).CACHE,
    "warnings": [(w.category.__name__, str(w.message)) for w in seen],
    "got": got.weights.tolist(), "got_aux": float(got.aux_loss),
    "want": want.weights.tolist(), "want_aux": float(want.aux_loss),
}, sys.stdout)
"""


def test_a_cache_that_cannot_be_written_falls_back_with_one_warning(tmp_path: Path) -> None:
    """A copy of the package where numba can write no cache (a file where its ``__pycache__``
    folder would be, HOME, XDG_CACHE_HOME and NUMBA_CACHE_DIR under a file: no folder can be
    made there, even by root): the gate takes the numba kernel, compiled in memory, gives the
    NumPy kernel's numbers (to float rounding) and warns once, naming NUMBA_CACHE_DIR."""
    pytest.importorskip("numba")
    site = tmp_path / "site"
    package = site / "dselectk"
    shutil.copytree(
        Path(dselectk.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__")
    )
    (package / "kernels" / "__pycache__").write_text("not a folder\n")
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder\n")
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "PYTHONDONTWRITEBYTECODE": "1",
        "HOME": str(blocked),
        "XDG_CACHE_HOME": str(blocked / "cache"),
        "NUMBA_CACHE_DIR": str(blocked / "numba"),
        "DSELECTK_KERNEL": "auto",
    }
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout)
    assert Path(out["package"]).is_relative_to(site)  # the copy, not this checkout
    assert out["node"] == "_NumbaGateLinear" and out["cache"] is False
    assert len(out["warnings"]) == 1, out["warnings"]
    category, message = out["warnings"][0]
    assert category == "RuntimeWarning"
    assert "cannot cache" in message and "NUMBA_CACHE_DIR" in message
    torch.testing.assert_close(torch.tensor(out["got"]), torch.tensor(out["want"]))
    assert out["got_aux"] == pytest.approx(out["want_aux"], rel=1e-5)


def test_a_cache_write_that_fails_runs_the_compiled_code_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """numba adds the compiled code to the function before it writes it to the cache: an
    OSError from that write (simulated: the first call of each kernel raises it) is followed by
    a second call on the code in memory, and one warning for the process, not one per kernel;
    the gate's numbers are the numba kernel's as usual."""
    pytest.importorskip("numba")
    monkeypatch.setenv(setting.KERNEL_ENV, "numba")
    nb = setting._load_numba("numba")
    torch.manual_seed(0)
    gate = DSelectK(8, 2, in_features=4, entropy_reg=0.1)
    x = torch.randn(5, 4, requires_grad=True)
    want = gate(x)
    (want_gx,) = torch.autograd.grad(want.weights.square().sum() + want.aux_loss, x)

    failed: list[str] = []
    for name in ("gate_forward", "gate_backward"):
        orig = getattr(nb, name)

        def once(*args: Any, _name: str = name, _orig: Any = orig) -> Any:
            if _name not in failed:
                failed.append(_name)
                raise PermissionError(13, "Permission denied", "/cache/index.nbi")
            return _orig(*args)

        monkeypatch.setattr(nb, name, once)
    monkeypatch.setattr(numba_nodes, "_READY", set())
    before, setting._cache_failed[0] = setting._cache_failed[0], False
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = gate(x)
            (got_gx,) = torch.autograd.grad(got.weights.square().sum() + got.aux_loss, x)
    finally:
        setting._cache_failed[0] = before
    assert failed == ["gate_forward", "gate_backward"]
    assert [w.category for w in seen] == [RuntimeWarning], [str(w.message) for w in seen]
    assert "NUMBA_CACHE_DIR" in str(seen[0].message) and "Permission denied" in str(seen[0].message)
    assert torch.equal(got.weights, want.weights) and torch.equal(got.aux_loss, want.aux_loss)
    assert torch.equal(got_gx, want_gx)
