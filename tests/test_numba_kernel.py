"""The compiled (numba) kernel of the DSelect-k gate and the ``DSELECTK_KERNEL`` switch.

With numba installed (the ``fast`` extra) CPU float32/float64 gates take
``dselectk.kernels.numba_cpu`` at every size. Checked here: the numba kernel = the NumPy host kernel
= the ATen kernels to float rounding (weights, auxiliary loss, grads of the input, weight and bias;
random shapes, n not a power of two, static and per-example gates, banks with one γ and λ per gate),
float64 gradcheck of every node through it, exact binary selections, the one-thread layer, which
kernel each value of the variable picks, and its errors (unknown value; numba asked for but missing,
simulated). The tests that need numba skip without it; the switch's tests run either way. No timings
here.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck

import dselectk.kernels
from dselectk import functional as DF
from dselectk.gates import DSelectK
from dselectk.kernels import dispatch, host_numpy, setting
from dselectk.kernels import numba_nodes as _numba_nodes
from dselectk.kernels.numba_nodes import _NumbaGate, _NumbaGateLinear

F64 = torch.float64
ENV = setting.KERNEL_ENV


@pytest.fixture
def numba_kernel(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Skip without numba; else pin the numba kernel and count its forward calls."""
    pytest.importorskip("numba")
    monkeypatch.setenv(ENV, "numba")
    nb = setting._load_numba("numba")
    calls: list[int] = []

    def spy(*args: Any, _orig: Any = nb.gate_forward) -> Any:
        calls.append(args[0].shape[0])
        return _orig(*args)

    monkeypatch.setattr(nb, "gate_forward", spy)
    return calls


def _outputs(
    gate: DSelectK, x: torch.Tensor | None, kernel: str, mp: pytest.MonkeyPatch, seed: int = 3
) -> list[torch.Tensor]:
    """Weights, aux loss and the grads of the input and parameters of a fixed random loss."""
    mp.setenv(ENV, kernel)
    out = gate(x)
    g = torch.randn(out.weights.shape, generator=torch.Generator().manual_seed(seed))
    loss = (out.weights * g.to(out.weights)).sum() + out.aux_loss
    inputs = ([] if x is None else [x]) + list(gate.parameters())
    grads = torch.autograd.grad(loss, inputs)
    return [out.weights.detach(), out.aux_loss.detach(), *grads]


def _random_case(rng: np.random.Generator) -> dict[str, Any]:
    n = int(rng.choice([2, 3, 5, 8, 13, 16, 33, 64, 100, 128, 257]))
    t = None if rng.random() < 0.5 else int(rng.integers(2, 4))
    per_gate = t is not None and rng.random() < 0.7
    return {
        "n": n,
        "k": int(rng.integers(1, min(n, 5) + 1)),
        "p": None if rng.random() < 0.3 else int(rng.integers(1, 9)),
        "t": t,
        "batch": int(rng.choice([1, 2, 7, 40, 300])),
        "gamma": list(rng.uniform(0.3, 2.0, t)) if per_gate else float(rng.uniform(0.3, 2.0)),
        "lam": list(rng.uniform(0.0, 1.0, t)) if per_gate else float(rng.uniform(0.0, 1.0)),
        "xi": float(rng.choice([0.0, 1.0])),
        "bias": bool(rng.random() < 0.8),
    }


CASES = [_random_case(np.random.default_rng(seed)) for seed in range(24)]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_numba_kernel_matches_numpy_and_aten(
    numba_kernel: list[int], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, case: Any
) -> None:
    torch.manual_seed(0)
    gate = DSelectK(
        case["n"], case["k"], in_features=case["p"], num_gates=case["t"], xi=case["xi"],
        bias=case["bias"], gamma=case["gamma"], entropy_reg=case["lam"],
    ).to(dtype)  # fmt: skip
    with torch.no_grad():
        for par in gate.parameters():
            par.mul_(30.0)  # a mix of binary and fractional bits
    x = None
    if case["p"] is not None:
        x = torch.randn(case["batch"], case["p"], dtype=dtype, requires_grad=True)
    with monkeypatch.context() as mp:
        got = _outputs(gate, x, "numba", mp)
        taken = len(numba_kernel)
        host = _outputs(gate, x, "numpy", mp)
        aten = _outputs(gate, x, "aten", mp)
    # the numba kernel took the gate, but with the unused-code penalty (the gate as written)
    penalty = case["n"] < 2 ** DF.num_bits(case["n"]) and case["xi"] > 0
    assert taken == (0 if penalty else 1)
    assert len(numba_kernel) == taken  # the other two did not call it
    tol = {"rtol": 1e-11, "atol": 1e-13} if dtype == F64 else {"rtol": 2e-5, "atol": 2e-6}
    for a, b, c in zip(got, host, aten, strict=True):
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape
        torch.testing.assert_close(a, c, **tol)
        torch.testing.assert_close(b, c, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_numba_kernel_at_a_large_batch(
    numba_kernel: list[int], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Above HOST_GATE_MAX_ELEMENTS (where the NumPy kernel gives way to ATen's fused one):
    still the numba kernel, the ATen numbers."""
    torch.manual_seed(0)
    gate = DSelectK(128, 4, in_features=16, entropy_reg=0.1).to(dtype)
    b = dispatch.HOST_GATE_MAX_ELEMENTS // (4 * 128) + 1
    x = torch.randn(b, 16, dtype=dtype, requires_grad=True)
    with monkeypatch.context() as mp:
        got = _outputs(gate, x, "numba", mp)
        want = _outputs(gate, x, "numpy", mp)  # ATen at this size
    assert numba_kernel == [b]
    tol = {"rtol": 1e-11, "atol": 1e-12} if dtype == F64 else {"rtol": 2e-5, "atol": 1e-5}
    for a, c in zip(got, want, strict=True):
        torch.testing.assert_close(a, c, **tol)


def test_numba_binary_bits_are_exact(numba_kernel: list[int]) -> None:
    """Binary S(Z): exact zeros off the selected codes, exact σ(α) on them, zero entropy."""
    alpha = torch.randn(3, 2, dtype=F64)
    z = torch.tensor([[[5.0, -5.0, 5.0], [-5.0, -5.0, 5.0]]] * 3, dtype=F64)
    logits = torch.cat((alpha, z.flatten(1)), dim=1)
    one = torch.tensor(1.0, dtype=F64)
    w, aux = _NumbaGate.apply(logits, one, one, 2, (3,), False)
    assert numba_kernel == [3]
    a = torch.softmax(alpha, -1)
    want = torch.zeros(3, 8, dtype=F64)
    want[:, 0b101] = a[:, 0]
    want[:, 0b100] = a[:, 1]
    torch.testing.assert_close(w, want, rtol=1e-15, atol=0)
    assert (w[:, [1, 2, 3, 6, 7]] == 0).all() and aux == 0


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
def test_numba_gate_node_matches_aten_and_gradcheck(
    numba_kernel: list[int], monkeypatch: pytest.MonkeyPatch, m: int
) -> None:
    """``_NumbaGate`` on a static bank of 3 gates (K = 2), one γ and one per gate: the ATen
    kernel's weights and λ Σ h, their grads, and float64 gradcheck."""
    torch.manual_seed(m)
    logits = (torch.randn(3, 2 * (1 + m), dtype=F64) * 0.6).requires_grad_()
    lam = torch.tensor([0.3, 0.0, 1.2], dtype=F64)
    for gamma in (torch.tensor(1.3, dtype=F64), torch.tensor([1.3, 0.4, 2.0], dtype=F64)):

        def f(lg: torch.Tensor, g: torch.Tensor = gamma) -> tuple[torch.Tensor, torch.Tensor]:
            w, aux = _NumbaGate.apply(lg, g, lam, 2, (3,), False)
            return w, aux

        assert gradcheck(f, (logits,))
        assert gradcheck(lambda lg: f(lg)[1], (logits,))
        w, aux = f(logits)
        monkeypatch.setenv(ENV, "aten")
        ref_w, ent = dispatch.dselect_k_fused(logits[:, :2], logits[:, 2:].view(3, 2, m), gamma)
        ref_aux = (lam * ent.sum(-1)).sum()
        monkeypatch.setenv(ENV, "numba")
        seed = torch.randn(w.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
        got = torch.autograd.grad((w * seed).sum() + aux, logits)
        want = torch.autograd.grad((ref_w * seed).sum() + ref_aux, logits)
        for a, b in zip((w, aux, *got), (ref_w, ref_aux, *want), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)
    assert numba_kernel


@pytest.mark.parametrize("per_example", [False, True])
def test_numba_gate_nodes_gradcheck(numba_kernel: list[int], per_example: bool) -> None:
    """Both one-node gates on the numba kernel, one γ and λ per gate (read as γ[g mod T]): the
    weights and the loss together, the weights alone, the loss alone."""
    torch.manual_seed(0)
    k, m, t = 2, 3, 3
    lead = (4, t) if per_example else (t,)
    logits = (torch.randn(*lead, k * (1 + m), dtype=F64) * 0.5).requires_grad_()
    gamma = torch.tensor([1.0, 0.7, 1.5], dtype=F64)
    lam = torch.tensor([0.2, 0.0, 1.0], dtype=F64)

    def f(lg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, aux = _NumbaGate.apply(lg.reshape(-1, lg.shape[-1]), gamma, lam, k, lead, per_example)
        return w, aux

    assert gradcheck(f, (logits,))
    assert gradcheck(lambda lg: f(lg)[0], (logits,))
    assert gradcheck(lambda lg: f(lg)[1], (logits,))
    if not per_example:
        return
    x = torch.randn(4, 5, dtype=F64, requires_grad=True)
    weight = (torch.randn(t * k * (1 + m), 5, dtype=F64) * 0.3).requires_grad_()
    bias = (torch.randn(t * k * (1 + m), dtype=F64) * 0.3).requires_grad_()
    one = torch.tensor(0.8, dtype=F64)  # one γ for the whole bank

    def h(*a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, aux = _NumbaGateLinear.apply(*a, one, lam, k, lead, True)
        return w, aux

    assert gradcheck(h, (x, weight, bias))
    assert gradcheck(lambda *a: h(*a)[0], (x, weight, bias))
    assert gradcheck(lambda *a: h(*a)[1], (x, weight, bias))
    assert gradcheck(lambda *a: h(a[0], a[1], None), (x, weight))


def test_numba_gate_loss_dtype_and_promotion(
    numba_kernel: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float64 λ buffer beside float32 logits promotes the loss as torch does: a single
    static gate's loss (a 0-d sum) to float64, a per-example gate's (a tensor of gates) not."""
    for in_features in (None, 5):
        gate = DSelectK(16, 2, in_features=in_features, entropy_reg=0.3)
        gate.register_buffer("_entropy_reg", torch.tensor(0.3, dtype=F64))
        x = None if in_features is None else torch.randn(3, 5, requires_grad=True)
        with monkeypatch.context() as mp:
            got, want = _outputs(gate, x, "numba", mp), _outputs(gate, x, "aten", mp)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)
    assert len(numba_kernel) == 2


def test_numba_gate_only_weights_only_loss_and_expanded_grads(
    numba_kernel: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    gate = DSelectK(16, 3, in_features=5, num_gates=2, entropy_reg=[0.3, 0.1]).double()
    x = torch.randn(4, 5, dtype=F64)
    uses = {
        "weights": lambda o: (o.weights**2).sum(),
        "aux": lambda o: o.aux_loss,
        "sum": lambda o: o.weights.sum() + 2.0 * o.aux_loss,  # an expanded grad of the weights
    }
    for use in uses.values():
        grads = []
        for kernel in ("numba", "aten"):
            monkeypatch.setenv(ENV, kernel)
            grads.append(torch.autograd.grad(use(gate(x)), list(gate.parameters())))
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)
    assert len(numba_kernel) == 3


def test_numba_gate_layer_runs_on_one_thread(
    numba_kernel: list[int], thread_spy: Callable[[ModuleType], list[int]]
) -> None:
    """The numba node's layer (and its backward) on one intra-op thread at every size (the
    kernel itself runs on the calling thread), the count restored after."""
    seen = thread_spy(_numba_nodes)
    gate = DSelectK(16, 2, in_features=4, entropy_reg=0.1)
    before = torch.get_num_threads()
    for b in (3, dispatch.HOST_GATE_MAX_ELEMENTS // 32 + 1):
        out = gate(torch.randn(b, 4))
        (out.weights.sum() + out.aux_loss).backward()
    assert seen == [1, 1, 1, 1] and torch.get_num_threads() == before
    assert len(numba_kernel) == 2


def test_numba_gate_raises_on_changed_entropy_weight(numba_kernel: list[int]) -> None:
    gate = DSelectK(8, 2, in_features=4, entropy_reg=0.1)
    out = gate(torch.randn(3, 4))
    gate._entropy_reg.fill_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.aux_loss.backward()
    assert numba_kernel == [3]


def test_numba_gate_dispatch(numba_kernel: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Which problems the numba kernel takes: float32/float64 at any size; not float16, not
    distinct codes, not an empty batch, not under a torch.func transform; and the variable is
    read at each call."""
    gate = DSelectK(8, 2, in_features=4, entropy_reg=0.1)
    gate(torch.randn(3, 4))
    gate(torch.randn(5000, 4))
    gate.double()(torch.randn(2, 4, dtype=F64))
    assert numba_kernel == [3, 5000, 2]
    DSelectK(8, 2, in_features=4, distinct=True)(torch.randn(3, 4))  # the gate as written
    gate(torch.zeros(0, 4, dtype=F64))
    gate.half()(torch.randn(3, 4).half())
    gate.float()
    from torch.func import functional_call, grad

    params = dict(gate.named_parameters())
    x = torch.randn(3, 4)
    g = grad(lambda p: functional_call(gate, p, (x,)).weights.square().sum())(params)
    assert set(g) == set(params)
    assert numba_kernel == [3, 5000, 2]
    for kernel in ("numpy", "aten", "NumBa", " numba "):
        monkeypatch.setenv(ENV, kernel)
        gate(torch.randn(3, 4))
    assert numba_kernel == [3, 5000, 2, 3, 3]
    DSelectK(8, 2, entropy_reg=0.1)()  # a static gate too
    assert numba_kernel == [3, 5000, 2, 3, 3, 1]


def test_kernel_env_rejects_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = DSelectK(8, 2, in_features=4)
    monkeypatch.setenv(ENV, "cuda")
    with pytest.raises(ValueError, match=r"DSELECTK_KERNEL='cuda' is not one of auto, numba"):
        gate(torch.randn(3, 4))
    monkeypatch.setenv(ENV, "")  # empty: auto
    gate(torch.randn(3, 4))


def _without_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make numba look absent (not installed, nothing imported yet)."""
    monkeypatch.setattr(setting, "_kernel_seen", [object(), "numpy"])
    monkeypatch.setattr(setting, "_numba_module", None)
    monkeypatch.setitem(sys.modules, "numba", None)
    monkeypatch.setitem(sys.modules, "dselectk.kernels.numba_cpu", None)
    monkeypatch.delattr(dselectk.kernels, "numba_cpu", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "numba" else real(name, *a)
    )


def test_kernel_env_numba_without_numba_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for and missing: an ImportError naming the extra, not another kernel."""
    _without_numba(monkeypatch)
    gate = DSelectK(8, 2, in_features=4)
    monkeypatch.setenv(ENV, "numba")
    with pytest.raises(ImportError, match=r"DSELECTK_KERNEL=numba .*dselectk\[fast\]"):
        gate(torch.randn(3, 4))


def test_kernel_auto_without_numba_is_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not installed: auto means the NumPy host kernel (the package without the extra)."""
    _without_numba(monkeypatch)
    for value in (None, "auto"):
        if value is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, value)
        assert setting._cpu_kernel() == "numpy"
    calls: list[int] = []
    orig = host_numpy._host_forward
    monkeypatch.setattr(host_numpy, "_host_forward", lambda *a: calls.append(1) or orig(*a))
    DSelectK(8, 2, in_features=4)(torch.randn(3, 4))
    assert calls == [1]


@pytest.mark.parametrize("kernel", ["numpy", "numba", "aten"])
def test_gate_under_func_grad_on_every_kernel(monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """torch.func.grad through a small gate: the nodes' forward runs with the transform lifted,
    and must still not take a host kernel (whose backward cannot read grad-tracking tensors)."""
    if kernel == "numba":
        pytest.importorskip("numba")
    from torch.func import functional_call, grad

    torch.manual_seed(0)
    gate = DSelectK(8, 2, in_features=4, entropy_reg=0.1)
    static = DSelectK(8, 2, entropy_reg=0.1)
    x = torch.randn(3, 4)
    for g in (gate, static):
        params = dict(g.named_parameters())
        args = (x,) if g is gate else ()

        def f(p: dict[str, torch.Tensor], g: DSelectK = g, args: Any = args) -> torch.Tensor:
            out = functional_call(g, p, args)
            return out.weights.square().sum() + out.aux_loss

        monkeypatch.setenv(ENV, kernel)
        got = grad(f)(params)
        monkeypatch.setenv(ENV, "aten")
        want = torch.autograd.grad(f(params), list(params.values()))
        for name, w in zip(params, want, strict=True):
            torch.testing.assert_close(got[name], w, rtol=1e-6, atol=1e-7)


def test_warm_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """0 where another kernel is picked; with numba, both dtypes ready afterwards."""
    monkeypatch.setenv(ENV, "aten")
    assert dselectk.kernels.warm_kernels() == 0.0
    pytest.importorskip("numba")
    monkeypatch.setenv(ENV, "numba")
    assert dselectk.kernels.warm_kernels() > 0.0
    nb = setting._load_numba("numba")
    assert len(nb.gate_forward.signatures) >= 2 and len(nb.gate_backward.signatures) >= 2


def test_logf_is_within_an_ulp(numba_kernel: list[int]) -> None:
    """The float32 log of the kernel (Cephes' logf in bit operations, so it vectorises): within
    one float32 ulp of the exact log, from the smallest normal number (the kernel's clamp) to 1
    and a little above, at the reduction's edges (√½) and at exact powers of two."""
    from numba import njit

    nb = setting._load_numba("numba")

    @njit
    def logs(x: Any, out: Any) -> None:  # pragma: no cover - compiled
        for i in range(x.size):
            out[i] = nb._logf(x[i])

    tiny = np.finfo(np.float32).tiny
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.random(200_000, dtype=np.float32),
            np.exp(rng.uniform(np.log(tiny), 0.0, 100_000)).astype(np.float32),
            2.0 ** np.arange(-126, 3, dtype=np.float32),
            np.nextafter(np.float32(0.70710678), np.float32([0.0, 1.0, 0.70710678])),
            np.float32([tiny, 1.0, 0.5, 1.0 - 2**-24, 1.5, 2.0]),
        ]
    ).astype(np.float32)
    x = np.maximum(x, tiny)
    got = np.empty_like(x)
    logs(x, got)
    exact = np.log(x.astype(np.float64))
    ulps = np.abs(got - exact) / np.spacing(np.abs(exact).astype(np.float32))
    assert got.dtype == np.float32 and float(ulps.max()) <= 1.0
    assert (got[x == 1.0] == 0.0).all()


def test_numba_module_imports_numba_and_numpy_only() -> None:
    """The kernel module (loaded lazily by kernels.setting) imports no dselectk module: no cycle."""
    import ast
    from pathlib import Path

    source = Path(setting.__file__).with_name("numba_cpu.py").read_text()
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.add(node.module or "")
    assert modules <= {"__future__", "typing", "numpy", "numba", "numba.extending"}


@pytest.mark.parametrize("rest", [7, 40])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("k", "m"), [(4, 7), (3, 4), (1, 1), (2, 6), (5, 3)])
def test_the_kernels_numbers_do_not_depend_on_the_tiling(
    numba_kernel: list[int], dtype: Any, k: int, m: int, rest: int
) -> None:
    """The kernels work by tiles (gates innermost, vectorised): wide tiles of _TILE gates, then
    the rest in one narrow tile (its products gate by gate), or from _PAD_FROM gates on in a
    wide tile padded with zero logits. Bit for bit the same numbers for every gate (no fused
    multiply-adds, the same order of operations), whichever tile a gate falls in: two wide
    tiles and a rest against each gate alone, with and without the weights' grad, γ, λ and the
    entropies' grads per gate; and the loss, summed gate after gate."""
    nb = setting._load_numba("numba")
    rng = np.random.default_rng(k * 10 + m)
    g = 2 * nb._TILE + rest
    assert (rest >= nb._PAD_FROM) == (nb.state_shape(g, k, m)[1] > g)
    logits = (rng.standard_normal((g, k * (1 + m))) * 0.8).astype(dtype)
    logits[rng.random(logits.shape) < 0.2] *= 10.0  # saturated bits (binary: exact zeros)
    gam = rng.uniform(0.5, 1.5, 3).astype(dtype)
    lam = rng.uniform(0.0, 1.0, 3)
    tiny = float(np.finfo(dtype).tiny)
    out, state = np.empty((g, 2**m), dtype), np.empty(nb.state_shape(g, k, m), dtype)
    loss = nb.gate_forward(logits, k, gam, lam, 1.0, tiny, out, state)
    g_out = rng.standard_normal((g, 2**m)).astype(dtype)
    g_ent = rng.standard_normal((g, k))
    total = 0.0
    for has_out in (True, False):
        grad = np.empty_like(logits)
        nb.gate_backward(k, gam, state, g_out, has_out, g_ent, 0.7, grad)
        for i in range(g):
            one_out, one_state = (
                np.empty((1, 2**m), dtype),
                np.empty(nb.state_shape(1, k, m), dtype),
            )
            one = (logits[i : i + 1], k, gam[i % 3 : i % 3 + 1], lam[i % 3 : i % 3 + 1])
            part = nb.gate_forward(*one, 1.0, tiny, one_out, one_state)
            one_grad = np.empty((1, logits.shape[1]), dtype)
            nb.gate_backward(
                k, one[2], one_state, g_out[i : i + 1], has_out, g_ent[i : i + 1], 0.7, one_grad
            )
            assert (one_out == out[i]).all() and (one_state[:, 0] == state[:, i]).all()
            assert (one_grad == grad[i]).all()
            total += part if has_out else 0.0
    assert loss == pytest.approx(total, rel=1e-12)
    assert np.isfinite(out).all() and np.isfinite(grad).all()
    assert numba_kernel == [g] + [1] * (2 * g)  # (the spy: each forward call's gates)


def test_a_first_call_that_compiles_says_so(
    numba_kernel: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first forward and backward of a dtype in a process warn when they took long (a
    compile: nothing cached), naming the cache and warm_kernels; later calls are silent."""
    import types
    import warnings

    clock = iter([0.0, 30.0, 100.0, 100.5])  # a 30 s forward (compiled), a 0.5 s backward
    monkeypatch.setattr(
        _numba_nodes, "time", types.SimpleNamespace(perf_counter=lambda: next(clock))
    )
    monkeypatch.setattr(_numba_nodes, "_READY", set())
    gate = DSelectK(8, 2, in_features=4, entropy_reg=0.1)
    with pytest.warns(RuntimeWarning, match=r"forward, float32\) took 30 s.*warm_kernels"):
        out = gate(torch.randn(3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (out.weights.sum() + out.aux_loss).backward()  # loaded from the cache: no warning
        gate(torch.randn(3, 4))
    assert _numba_nodes._READY == {("forward", "f"), ("backward", "f")}
