"""Test-only helpers: pause points, and the CPU-vs-CUDA comparison of the GPU tests.

Pause points: a process under test stops at a known point and waits to be killed.

Interruption tests (``kill -9`` of a sweep, mid-record or between records) must not depend on
timing. With ``DSELECTK_PAUSE_AT="<point>@<count>@<barrier file>"`` in its environment, a
process that reaches ``<point>`` for the ``<count>``-th time creates ``<barrier file>`` (holding
its pid) and then waits until it is killed, or until the test creates ``<barrier file>.release``;
the test waits for the barrier, then acts. Points:

* ``record-saved`` — right after a run record was written (:meth:`RunStore.save`);
* ``before-replace/<folder>`` — inside an atomic write into ``<folder>`` (e.g. ``runs``), after
  the temp file is complete and before it is renamed over the destination (mid-record).

Unset (always, outside tests), a pause point costs one environment lookup.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = ["PAUSE_ENV", "assert_same_step", "cuda_pair", "grads", "pause_point"]

PAUSE_ENV = "DSELECTK_PAUSE_AT"
_counts: dict[str, int] = {}


def pause_point(name: str) -> None:
    """Pause here forever if the environment asks for this point (see the module docstring)."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    try:
        point, count, barrier = spec.split("@", 2)
        target = int(count)
    except ValueError:
        raise ValueError(
            f"{PAUSE_ENV} must be '<point>@<count>@<barrier file>', got {spec!r}"
        ) from None
    if point != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] != target:
        return
    Path(barrier).write_text(f"{os.getpid()}\n", encoding="utf-8")
    release = Path(f"{barrier}.release")
    while not release.exists():  # until the test kills this process, or releases it
        time.sleep(0.05)


def cuda_pair(module: Any) -> tuple[Any, Any]:
    """The module on the CPU and an exact copy on CUDA (float64 both): the GPU tests' pair."""
    import copy

    cpu = module.double()
    return cpu, copy.deepcopy(cpu).to("cuda")


def grads(module: Any) -> dict[str, Any]:
    """Every parameter's gradient, on the CPU, by name (parameters without one left out)."""
    return {n: p.grad.detach().cpu() for n, p in module.named_parameters() if p.grad is not None}


def assert_same_step(cpu: Any, gpu: Any, loss_of: Any, rel: float = 1e-9, **tol: float) -> None:
    """``loss_of(module, device)`` on both copies, backward, then the losses (``rel``) and every
    parameter's gradient (``tol``: assert_close's tolerances) compared. Needs pytest (tests only).
    """
    import pytest
    import torch

    losses = []
    for mod, dev in ((cpu, "cpu"), (gpu, "cuda")):
        loss = loss_of(mod, dev)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=rel)
    for key, g in grads(cpu).items():
        torch.testing.assert_close(grads(gpu)[key], g, msg=key, **tol)
