"""The fused DSelect-k node and the fused softmax-selector gate against their plain formulations.

Complements ``test_fast_paths.py``: more shapes (K = 1, odd and even M, n not a power of two),
float64 gradchecks, the gates' static banks and per-example layouts, and the ablation gate's
limits (-inf logits, temperature 1e-16).
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from dselectk import functional as DF
from dselectk.gates import DSelectK, SoftmaxSelectorGate
from dselectk.gates.registry import make_gate
from dselectk.kernels import dispatch

# exercise the fused kernel itself, also on problems small enough that dselect_k_fused
# would otherwise compose autograd ops (see the fixture in conftest.py)
pytestmark = pytest.mark.usefixtures("always_fused_kernel")


F64 = torch.float64


def _composed(alpha: torch.Tensor, z: torch.Tensor, gamma: float) -> tuple:
    """q̃ and the selector entropies by the plain autograd formulation (no fused node)."""
    p = DF.smooth_step(z, gamma)
    w = DF._expand_bits(p, torch.softmax(alpha, dim=-1).unsqueeze(-1)).sum(dim=-2)
    return w, DF.selector_entropy(p)


def _inputs(lead: tuple[int, ...], k: int, m: int, scale: float, dtype=F64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(*lead, k, m, generator=gen, dtype=dtype) * scale).requires_grad_()
    alpha = (torch.randn(*lead, k, generator=gen, dtype=dtype) * 2).requires_grad_()
    return z, alpha


def _grads(fn, alpha, z, g_w, g_e):
    w, ent = fn(alpha, z)
    loss = (w * g_w).sum() + (ent * g_e).sum()
    return (w, ent, *torch.autograd.grad(loss, (z, alpha)))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0])
def test_fused_equals_composed(m: int, k: int, scale: float) -> None:
    z, alpha = _inputs((11,), k, m, scale)
    gen = torch.Generator().manual_seed(1)
    g_w = torch.randn(11, 2**m, generator=gen, dtype=F64)
    g_e = torch.randn(11, k, generator=gen, dtype=F64)
    got = _grads(lambda a, zz: dispatch.dselect_k_fused(a, zz, 1.7), alpha, z, g_w, g_e)
    want = _grads(lambda a, zz: _composed(a, zz, 1.7), alpha, z, g_w, g_e)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7])
def test_fused_gradcheck_shapes(m: int) -> None:
    z, alpha = _inputs((3,), 3, m, 0.5)
    assert gradcheck(lambda a, zz: dispatch.dselect_k_fused(a, zz, 1.1), (alpha, z))


@pytest.mark.parametrize("m", [5, 7])
def test_fused_float32_large_batch(m: int) -> None:
    z, alpha = _inputs((2048,), 4, m, 3.0, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    g_w = torch.randn(2048, 2**m, generator=gen)
    g_e = torch.randn(2048, 4, generator=gen)
    got = _grads(lambda a, zz: dispatch.dselect_k_fused(a, zz, 10.0), alpha, z, g_w, g_e)
    plain = _grads(lambda a, zz: _composed(a, zz, 10.0), alpha, z, g_w, g_e)
    z64, a64 = (t.detach().double().requires_grad_() for t in (z, alpha))
    truth = _grads(lambda a, zz: _composed(a, zz, 10.0), a64, z64, g_w.double(), g_e.double())
    for x, y, t in zip(got, plain, truth):  # no less accurate than the plain float32 form
        err, err_plain = ((v.double() - t).abs().max().item() for v in (x, y))
        assert err <= 1.5 * err_plain + 1e-6


@pytest.mark.parametrize("m", [2, 5])
def test_fused_only_one_output_used(m: int) -> None:
    z, alpha = _inputs((5,), 3, m, 0.7)
    w, ent = dispatch.dselect_k_fused(alpha, z, 1.0)
    w0, ent0 = _composed(alpha, z, 1.0)
    for out, ref in ((w.pow(2).sum(), w0.pow(2).sum()), (ent.sum(), ent0.sum())):
        got = torch.autograd.grad(out, (z, alpha), retain_graph=True, allow_unused=True)
        want = torch.autograd.grad(ref, (z, alpha), retain_graph=True, allow_unused=True)
        for a, b in zip(got, want):
            a = torch.zeros_like(b) if a is None else a
            b = torch.zeros_like(a) if b is None else b
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("n", [5, 8, 32, 100])
@pytest.mark.parametrize("layout", ["bank", "per_example", "per_example_bank"])
def test_dselect_k_gate_equals_composed(n: int, layout: str) -> None:
    torch.manual_seed(0)
    kw: dict = {"entropy_reg": 0.3, "gamma": 2.0}
    if layout == "bank":
        gate = DSelectK(n, 3, num_gates=7, **kw).double()
        x = None
    else:
        gate = DSelectK(n, 3, in_features=6, num_gates=None if layout == "per_example" else 2, **kw)
        gate = gate.double()
        x = torch.randn(9, 6, dtype=F64)
    with torch.no_grad():
        for prm in gate.parameters():
            prm.mul_(50.0)  # a mix of fractional and binary bits
    logits = gate.compute_logits(x).detach().requires_grad_()
    out = gate.gate(logits)
    alpha, z = gate.split_logits(logits)
    w0 = _composed(alpha, z, 2.0)[0]
    torch.testing.assert_close(out.weights, w0[..., :n], rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out.weights)
    (got,) = torch.autograd.grad((out.weights * g).sum() + out.aux_loss, logits)
    ref = gate.gate(logits)  # same aux formula; the weights' grad from the composed form
    (want,) = torch.autograd.grad((w0[..., :n] * g).sum() + ref.aux_loss, logits)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# -- softmax-selector ablation gate -------------------------------------------------------------


def _ablation_reference(gate: SoftmaxSelectorGate, logits: torch.Tensor):
    a, s = gate.selectors(logits)
    weights = (a.unsqueeze(-1) * s).sum(dim=-2)
    aux = gate._reduce_aux(gate._entropy_reg * DF.entropy(s).sum(dim=-1))
    return weights, aux


@pytest.mark.parametrize("layout", ["single", "bank", "per_example", "per_example_bank"])
@pytest.mark.parametrize("temperature", [1.0, 0.05])
@pytest.mark.parametrize("reg", [0.0, 0.3])
def test_ablation_gate_equals_reference(layout: str, temperature: float, reg: float) -> None:
    torch.manual_seed(0)
    kw: dict = {"temperature": temperature, "entropy_reg": reg, "init_std": 1.0}
    x = None
    if layout == "single":
        gate = SoftmaxSelectorGate(7, 3, **kw)
    elif layout == "bank":
        gate = SoftmaxSelectorGate(7, 3, num_gates=5, **kw)
    else:
        ng = None if layout == "per_example" else 2
        gate = SoftmaxSelectorGate(7, 3, in_features=4, num_gates=ng, **kw)
        x = torch.randn(6, 4, dtype=F64)
    gate = gate.double()
    logits = gate.compute_logits(x).detach().requires_grad_()
    out = gate.gate(logits)
    w0, aux0 = _ablation_reference(gate, logits)
    torch.testing.assert_close(out.weights, w0)
    torch.testing.assert_close(out.aux_loss, aux0)
    g = torch.randn_like(w0)
    (got,) = torch.autograd.grad((out.weights * g).sum() + 1.7 * out.aux_loss, logits)
    (want,) = torch.autograd.grad((w0 * g).sum() + 1.7 * aux0, logits)
    torch.testing.assert_close(got, want)
    fn = lambda lg: tuple(gate.gate(lg))  # noqa: E731
    assert gradcheck(fn, (logits,))
    # Only the weights, or only the entropy, used.
    (gw,) = torch.autograd.grad(gate.gate(logits).weights.sum(), logits)
    (gw0,) = torch.autograd.grad(_ablation_reference(gate, logits)[0].sum(), logits)
    torch.testing.assert_close(gw, gw0)
    if reg:
        (ge,) = torch.autograd.grad(gate.gate(logits).aux_loss, logits)
        (ge0,) = torch.autograd.grad(_ablation_reference(gate, logits)[1], logits)
        torch.testing.assert_close(ge, ge0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_ablation_gate_limits_stay_finite(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    gate = make_gate("ablation_entropy", 8, num_gates=3, k=2, entropy_reg=0.5).to(dtype)
    for temperature in (1e-16, 1e-3, 1.0):
        gate.temperature = temperature
        with torch.no_grad():
            gate.logits[0, 2 + 3] = float("-inf")  # a -inf logit in gate 0, selector 0
        logits = gate.logits.detach().clone().requires_grad_()
        out = gate.gate(logits)
        w0, aux0 = _ablation_reference(gate, logits)
        assert torch.isfinite(out.weights).all() and torch.isfinite(out.aux_loss)
        torch.testing.assert_close(out.weights, w0)
        torch.testing.assert_close(out.aux_loss, aux0)
        g = torch.randn_like(w0)
        (got,) = torch.autograd.grad((out.weights * g).sum() + out.aux_loss, logits)
        (want,) = torch.autograd.grad((w0 * g).sum() + aux0, logits)
        assert torch.isfinite(got).all()
        # In float32 both forms carry rounding errors amplified by 1/τ (~5e-5 at τ = 1e-3).
        tol = {"rtol": 1e-3, "atol": 2e-4} if dtype == torch.float32 else {}
        torch.testing.assert_close(got, want, **tol)
        if temperature == 1e-16:  # one-hot selectors: exactly zero grad of β
            assert got[:, 2:].abs().max().item() == 0.0
            torch.testing.assert_close(out.weights, gate.hard_weights())


def test_ablation_gate_works_with_torch_func() -> None:
    from torch.func import grad, vmap

    torch.manual_seed(0)
    gate = SoftmaxSelectorGate(6, 2, in_features=3, entropy_reg=0.2).double()
    x = torch.randn(4, 3, dtype=F64)
    logits = gate.compute_logits(x).detach()

    def loss(lg: torch.Tensor) -> torch.Tensor:
        out = gate.gate(lg.unsqueeze(0))
        return (out.weights**2).sum() + out.aux_loss

    got = vmap(grad(loss))(logits)
    for i in range(4):
        lg = logits[i].clone().requires_grad_()
        (want,) = torch.autograd.grad(loss(lg), lg)
        torch.testing.assert_close(got[i], want)


def test_fused_kernel_takes_one_gamma_per_gate() -> None:
    """A (G,) γ gives each gate the result of its own scalar γ (values and gradients)."""
    torch.manual_seed(0)
    gammas = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    z = (torch.randn(3, 4, 5, dtype=torch.float64) * 0.8).requires_grad_()
    a = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w, ent = dispatch.dselect_k_fused(a, z, gammas)
    g = torch.randn_like(w)
    gz, ga = torch.autograd.grad((w * g).sum() + ent.sum(), (z, a))
    for i, gamma in enumerate(gammas.tolist()):
        wi, ei = dispatch.dselect_k_fused(a[i], z[i], gamma)
        gzi, gai = torch.autograd.grad((wi * g[i]).sum() + ei.sum(), (z, a))
        torch.testing.assert_close(w[i], wi)
        torch.testing.assert_close(ent[i], ei)
        torch.testing.assert_close(gz[i], gzi[i])
        torch.testing.assert_close(ga[i], gai[i])
    torch.testing.assert_close(
        DF.smooth_step(z, gammas[:, None, None]),
        torch.stack([DF.smooth_step(z[i], float(gammas[i])) for i in range(3)]),
    )
    with pytest.raises(ValueError, match="gamma must be a finite number > 0"):
        dispatch.dselect_k_fused(a, z, torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64))


@pytest.mark.parametrize("threshold", [0, 10**9])  # the kernel, then the composed ops
def test_small_problem_dispatch_gives_the_same_numbers(
    threshold: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(1)
    z = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    a = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    gammas = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    monkeypatch.setattr(dispatch, "FUSED_MIN_ELEMENTS", threshold)
    for gamma in (1.3, gammas):
        w, ent = dispatch.dselect_k_fused(a, z, gamma)
        g = gamma if isinstance(gamma, float) else gamma[:, None, None]
        p = DF.smooth_step(z, g)
        torch.testing.assert_close(ent, DF.selector_entropy(p))
        want = (torch.softmax(a, -1)[..., None] * DF.selector(p)).sum(-2)
        torch.testing.assert_close(w, want)
    assert gradcheck(lambda aa, zz: dispatch.dselect_k_fused(aa, zz, gammas), (a, z))


def test_ablation_gate_small_temperature_flush_equals_plain_exp() -> None:
    """At τ <= the flush temperature the node zeroes probabilities below float32's smallest
    normal before exp (CPU speed); everything else equals the composed softmax formulas."""
    from dselectk.gates.ablation import _FLUSH_TEMPERATURE

    torch.manual_seed(0)
    k, n = 4, 32
    gate = SoftmaxSelectorGate(n, k, num_gates=64, temperature=1e-3)
    assert gate.temperature <= _FLUSH_TEMPERATURE
    with torch.no_grad():
        gate.logits.mul_(1e4)  # spread like trained logits: most β/τ far below exp's range
    logits = gate.compute_logits().detach().requires_grad_()
    out = gate.gate(logits)
    alpha, beta = logits[..., :k], logits[..., k:].unflatten(-1, (k, n))
    s = torch.softmax(beta / gate.temperature, dim=-1)
    want = (torch.softmax(alpha, -1).unsqueeze(-1) * s).sum(-2)
    tiny = torch.finfo(torch.float32).tiny
    assert (s < tiny).float().mean() > 0.5  # the flushed regime is exercised
    torch.testing.assert_close(out.weights, want, rtol=1e-6, atol=tiny)
    assert not ((out.weights > 0) & (out.weights < tiny)).any()  # no denormals left
    (g,) = torch.autograd.grad(out.weights.square().sum(), logits)
    (g_ref,) = torch.autograd.grad(want.square().sum(), logits)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


# -- module layout: the kernels live in dselectk.kernels --------------------------------------


def test_kernels_module_imports_torch_only() -> None:
    """The ATen kernels import no dselectk module but runtime and the kernels' arithmetic and
    setting below them (dispatch and gates import them: no cycle); those import no dselectk
    module but runtime, runtime and functional none (functional is pure math)."""
    import ast
    import inspect

    from dselectk import runtime
    from dselectk.kernels import aten as _kernels
    from dselectk.kernels import host_numpy, setting

    def imports(module: object) -> set[str]:
        tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
        modules: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                modules.add(node.module or "")
        return modules

    below = {"dselectk.runtime", "dselectk.kernels.host_numpy", "dselectk.kernels.setting"}
    assert {m.split(".")[0] for m in imports(_kernels) - below} <= {
        "__future__", "math", "typing", "torch"
    }  # fmt: skip
    for lower in (host_numpy, setting):
        assert not [m for m in imports(lower) - {"dselectk.runtime"} if m.startswith("dselectk")]
    assert not [m for m in imports(runtime) if m.startswith("dselectk")]
    assert not [m for m in imports(DF) if m.startswith("dselectk")]


def test_functional_is_pure_math_and_names_stay_importable() -> None:
    import inspect

    from dselectk.gates import ablation
    from dselectk.kernels import aten as _kernels

    defined_here = [
        obj for obj in vars(DF).values() if inspect.isclass(obj) and obj.__module__ == DF.__name__
    ]
    assert not [c for c in defined_here if issubclass(c, torch.autograd.Function)]
    for name in DF.__all__:  # every public function is still there
        assert callable(getattr(DF, name)), name
    # the old import locations of the moved names still work
    assert ablation._SelectorGate is _kernels._SelectorGate
    assert ablation._softmax_small is _kernels._softmax_small
    assert ablation._FLUSH_TEMPERATURE == _kernels._FLUSH_TEMPERATURE
    assert issubclass(_kernels._DSelectFused, torch.autograd.Function)
    assert issubclass(_kernels._SelectorGate, torch.autograd.Function)


def test_selector_kernel_takes_one_temperature_per_gate() -> None:
    """A (T, 1, 1) τ gives gate t of a static and of a per-example bank its own τ's numbers."""
    from dselectk.kernels.aten import _SelectorGate

    torch.manual_seed(0)
    taus = torch.tensor([1.0, 0.05, 0.3], dtype=F64)
    for lead in [(3,), (4, 3)]:
        logits = torch.randn(*lead, 2 * (1 + 6), dtype=F64, requires_grad=True)
        w, ent = _SelectorGate.apply(logits, taus[:, None, None], 2)[:2]
        g = torch.randn_like(w)
        (grad,) = torch.autograd.grad((w * g).sum() + ent.sum(), logits)
        for t in range(3):
            lg = logits[..., t, :].detach().requires_grad_()
            wt, et = _SelectorGate.apply(lg, taus[t], 2)[:2]
            (gt,) = torch.autograd.grad((wt * g[..., t, :]).sum() + et.sum(), lg)
            torch.testing.assert_close(w[..., t, :], wt, rtol=0, atol=0)
            torch.testing.assert_close(ent[..., t, :], et, rtol=0, atol=0)
            torch.testing.assert_close(grad[..., t, :], gt, rtol=1e-14, atol=1e-15)
