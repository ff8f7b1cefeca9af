"""Issue 25's one-thread paths of the per-example DSelect-k gate (steady beside busy processes).

The host node (``_DSelectSmallGateLinear``) runs its linear layer on one intra-op thread; other
problems below ``runtime.PARALLEL_MIN_ELEMENTS`` take the layer and the split of the logits
through ``_OneThreadSplitLinear`` (forward and backward on one thread) and then the gate's math
as written, and ``DSelectK.compute_logits`` runs the layer through ``_OneThreadLinear``. Checked
here: the thread count inside the nodes and after them, values and gradients against the layer
and the gate as written (float rounding: MKL's product may round differently on one thread and
on two), float64 gradcheck, no-grad, non-contiguous input, a layer without bias, which path the
gate takes, and torch.compile (the node is taken in eager mode only). No timings here.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.autograd import gradcheck

from dselectk.gates import DSelectK
from dselectk.kernels import aten as _kernels
from dselectk.kernels import dispatch
from dselectk.kernels.aten import _DSelectSmallGateLinear, _OneThreadLinear, _OneThreadSplitLinear
from dselectk.runtime import _OneThread

F64 = torch.float64


#: these tests are about the NumPy host kernel and its size limits (conftest's numpy_kernel)
pytestmark = pytest.mark.usefixtures("numpy_kernel")


def _spy(monkeypatch: pytest.MonkeyPatch, cls: Any) -> list[int]:
    calls: list[int] = []

    def spy(*args: Any, _orig: Any = cls.apply) -> Any:
        calls.append(torch.get_num_threads())
        return _orig(*args)

    monkeypatch.setattr(cls, "apply", spy)
    return calls


def test_one_thread_scope_restores_and_nests() -> None:
    before = torch.get_num_threads()
    with _OneThread():
        assert torch.get_num_threads() == 1
        with _OneThread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), _OneThread():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("bias", [True, False])
def test_one_thread_linear_gradcheck(bias: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=F64, requires_grad=True)
    w = torch.randn(3, 4, dtype=F64, requires_grad=True)
    b = torch.randn(3, dtype=F64, requires_grad=True) if bias else None
    args = (x, w, b) if bias else (x, w)
    assert gradcheck(lambda *a: _OneThreadLinear.apply(*a, *([] if bias else [None])), args)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("bias", [True, False])
def test_one_thread_linear_is_the_layer_on_one_thread(dtype: torch.dtype, bias: bool) -> None:
    """Bit for bit ``F.linear`` and its autograd backward run on one thread; the threads are
    one inside the node (forward and backward) and restored after it."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=bias).to(dtype)
    x = torch.randn(300, 64, dtype=dtype)[::2]  # non-contiguous rows
    g = torch.randn(150, 32, dtype=dtype)
    before = torch.get_num_threads()
    out = _OneThreadLinear.apply(x, layer.weight, layer.bias)
    got = torch.autograd.grad(out, list(layer.parameters()), g)
    assert torch.get_num_threads() == before
    with _OneThread():
        want_out = layer(x)
        want = torch.autograd.grad(want_out, list(layer.parameters()), g)
    for a, b in zip((out, *got), (want_out, *want), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(
            _OneThreadLinear.apply(x, layer.weight, layer.bias), want_out, rtol=0, atol=0
        )


def _outputs(gate: DSelectK, x: torch.Tensor, as_written: bool = False) -> list[torch.Tensor]:
    if as_written:  # the module's layer and the gate's math, all on one thread
        with _OneThread():
            out = gate.gate(gate.proj(x).view(x.shape[0], -1))
    else:
        out = gate(x)
    g = torch.randn(out.weights.shape, generator=torch.Generator().manual_seed(3))
    loss = (out.weights * g.to(out.weights)).sum() + out.aux_loss
    grads = torch.autograd.grad(loss, [x, *gate.parameters()])
    return [out.weights.detach(), out.aux_loss.detach(), *grads]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("bias", [True, False])
def test_gate_above_host_size_takes_the_one_thread_layer(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, bias: bool
) -> None:
    """Above HOST_GATE_MAX_ELEMENTS: the layer on one thread, then the gate as written: bit
    for bit the module's layer and gate run on one thread; the threads restored."""
    torch.manual_seed(0)
    gate = DSelectK(16, 2, in_features=6, entropy_reg=0.2, bias=bias).to(dtype)
    b = dispatch.HOST_GATE_MAX_ELEMENTS // (2 * 16) + 1  # examples x K x N > the host node's size
    x = torch.randn(b, 12, dtype=dtype)[:, ::2].requires_grad_()  # non-contiguous input
    calls = _spy(monkeypatch, _OneThreadSplitLinear)
    host = _spy(monkeypatch, _DSelectSmallGateLinear)
    before = torch.get_num_threads()
    got = _outputs(gate, x)
    assert torch.get_num_threads() == before
    assert calls == [before] and host == []
    want = _outputs(gate, x, as_written=True)
    assert calls == [before]
    for a, b in zip(got, want, strict=True):  # the same ATen calls on one thread
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(gate(x).weights, want[0], rtol=0, atol=0)
    out = gate(x)  # on two threads (where there are two): the same numbers to float rounding
    tol = {"rtol": 1e-12, "atol": 1e-14} if dtype == F64 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(out.weights, gate.gate(gate.proj(x)).weights, **tol)


def test_gate_one_thread_layer_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer on one thread below PARALLEL_MIN_ELEMENTS (CPU float32/float64, eager) where
    the host node does not take the problem; not above, for float16, with hooks, with an input
    check, for a subclass's own math or under a torch.func transform."""
    limit = dispatch.HOST_GATE_MAX_ELEMENTS // (2 * 16)  # examples at the host node's size
    monkeypatch.setattr("dselectk.gates.dselect_k.PARALLEL_MIN_ELEMENTS", 4 * limit * 32)
    calls = _spy(monkeypatch, _OneThreadSplitLinear)
    logits = _spy(monkeypatch, _OneThreadLinear)
    gate = DSelectK(16, 2, in_features=4)
    gate(torch.randn(limit, 4))  # the host node
    assert calls == []
    gate(torch.randn(limit + 1, 4))  # the one-thread layer, then the gate as written
    DSelectK(16, 2, in_features=4, distinct=True)(torch.randn(3, 4))  # not the host node's math
    DSelectK(5, 2, in_features=4)(torch.randn(3, 4))  # the unused-code penalty
    gate.double()(torch.randn(limit + 1, 4, dtype=F64))
    assert len(calls) == 4 and logits == []
    gate(torch.randn(4 * limit, 4, dtype=F64))  # PARALLEL_MIN_ELEMENTS: two threads may share it
    gate.half()(torch.randn(limit + 1, 4).half())
    gate.float()
    handle = gate.proj.register_forward_hook(lambda *a: None)
    gate(torch.randn(limit + 1, 4))
    handle.remove()
    assert len(calls) == 4 and logits == []

    class Own(DSelectK):
        def gate(self, lg: torch.Tensor) -> Any:
            return super().gate(lg)

    Own(16, 2, in_features=4)(torch.randn(3, 4))  # its own gate: the logits on one thread
    gate.bits(torch.randn(3, 4))
    assert len(calls) == 4 and len(logits) == 2
    from torch.func import functional_call, grad

    params = dict(gate.named_parameters())
    x = torch.randn(limit + 1, 4)
    g = grad(lambda p: functional_call(gate, p, (x,)).weights.square().sum())(params)
    assert len(calls) == 4 and len(logits) == 2 and set(g) == set(params)


@pytest.mark.parametrize("num_gates", [None, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_split_linear_gradcheck(num_gates: int | None, bias: bool) -> None:
    torch.manual_seed(0)
    k, m, t = 2, 3, num_gates or 1
    lead = (5,) if num_gates is None else (5, t)
    x = torch.randn(5, 4, dtype=F64, requires_grad=True)
    w = torch.randn(t * k * (1 + m), 4, dtype=F64, requires_grad=True)
    b = torch.randn(t * k * (1 + m), dtype=F64, requires_grad=True)

    def f(*a: torch.Tensor) -> Any:
        return _OneThreadSplitLinear.apply(a[0], a[1], a[2] if bias else None, lead, k, m)

    args = (x, w, b) if bias else (x, w)
    assert gradcheck(f, args)
    assert gradcheck(lambda *a: f(*a)[0], args)  # only α: Z's grad is None
    assert gradcheck(lambda *a: f(*a)[1], args)  # only Z
    alpha, z = f(*args)
    logits = torch.nn.functional.linear(x, w, b if bias else None).view(*lead, -1)
    torch.testing.assert_close(alpha, logits[..., :k])
    torch.testing.assert_close(z, logits[..., k:].unflatten(-1, (k, m)))


def test_gate_split_path_only_weights_or_only_loss_and_bank() -> None:
    """The split path of a bank (B, T, ...) and of a single gate, grads of the weights only or
    of the loss only: the numbers of the gate as written on one thread."""
    torch.manual_seed(0)
    for t in (None, 3):
        gate = DSelectK(16, 3, in_features=5, num_gates=t, entropy_reg=0.3, distinct=True).double()
        x = torch.randn(7, 5, dtype=F64)
        for use in ("weights", "aux"):
            grads = []
            for as_written in (False, True):
                if as_written:
                    with _OneThread():
                        logits = gate.proj(x).view(7, *([t] if t else []), -1)
                        out = gate.gate(logits)
                else:
                    out = gate(x)
                loss = (out.weights**2).sum() if use == "weights" else out.aux_loss
                grads.append(torch.autograd.grad(loss, list(gate.parameters())))
            for a, b in zip(*grads, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_host_node_runs_on_one_thread(thread_spy: Callable[[ModuleType], list[int]]) -> None:
    """The host node's layer (and its backward) on one thread, the count restored after."""
    seen = thread_spy(_kernels)
    gate = DSelectK(16, 2, in_features=4, entropy_reg=0.1)
    before = torch.get_num_threads()
    out = gate(torch.randn(3, 4))
    (out.weights.sum() + out.aux_loss).backward()
    assert seen == [1, 1] and torch.get_num_threads() == before


def test_gate_one_thread_layer_under_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile the gate is traced as written (the node is eager-only): compiled =
    eager to float rounding, and the node is not called while compiling."""
    torch.manual_seed(0)
    gate = DSelectK(16, 2, in_features=4, entropy_reg=0.1)
    x = torch.randn(dispatch.HOST_GATE_MAX_ELEMENTS // (2 * 16) + 1, 4)
    eager = gate(x).weights
    calls = _spy(monkeypatch, _OneThreadSplitLinear)
    logits = _spy(monkeypatch, _OneThreadLinear)
    compiled = torch.compile(gate, backend="eager")(x).weights
    assert calls == [] and logits == []
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_gates", [None, 2])
def test_gate_split_path_empty_batch(num_gates: int | None) -> None:
    """Zero examples: zero weights rows, a zero loss, grads of zeros (as the gate as written)."""
    gate = DSelectK(16, 2, in_features=4, num_gates=num_gates, entropy_reg=0.1)
    x = torch.zeros(0, 4, requires_grad=True)
    out = gate(x)
    assert out.weights.shape == (0, *([num_gates] if num_gates else []), 16)
    (out.weights.sum() + out.aux_loss).backward()
    assert x.grad is not None and x.grad.shape == (0, 4)
    assert all(p.grad is not None and not p.grad.any() for p in gate.parameters())
