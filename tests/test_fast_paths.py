"""Fast paths give the same numbers and gradients as the straightforward formulations.

No timings here (those live in ``benchmarks/``): every test compares a fast path with the plain
formulation of the same math, in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dselectk import functional as DF
from dselectk.gates import DSelectK, DSelectKExtended, TopKGate
from dselectk.kernels import dispatch
from dselectk.layers import StackedMLP
from dselectk.models import MoE, MultiGateMoE

# exercise the fused kernel itself, also on problems small enough that dselect_k_fused
# would otherwise compose autograd ops (see the fixture in conftest.py)
pytestmark = pytest.mark.usefixtures("always_fused_kernel")


F64 = torch.float64


def naive_gate(alpha: torch.Tensor, z: torch.Tensor, gamma: float) -> tuple:
    """The paper's formulas coded directly: code table, where, prod; entropy over the n-vector."""
    r = DF.selector_naive(DF.smooth_step(z, gamma))  # (..., K, N)
    weights = (torch.softmax(alpha, dim=-1).unsqueeze(-1) * r).sum(dim=-2)
    return weights, DF.entropy(r)


def _inputs(lead: tuple[int, ...], k: int, m: int, scale: float, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(*lead, k, m, generator=gen, dtype=F64) * scale).requires_grad_()
    alpha = torch.randn(*lead, k, generator=gen, dtype=F64).requires_grad_()
    return z, alpha


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 10])
@pytest.mark.parametrize("lead", [(), (3,), (5, 2)])
@pytest.mark.parametrize("scale", [0.05, 0.6, 3.0])  # interior, mixed, mostly binary bits
def test_fused_matches_product_table(m: int, lead: tuple[int, ...], scale: float) -> None:
    k, gamma = 3, 0.9
    z, alpha = _inputs(lead, k, m, scale)
    gen = torch.Generator().manual_seed(1)
    g_w = torch.randn(*lead, 2**m, generator=gen, dtype=F64)
    g_e = torch.randn(*lead, k, generator=gen, dtype=F64)

    w, ent = dispatch.dselect_k_fused(alpha, z, gamma)
    grads = torch.autograd.grad((w * g_w).sum() + (ent * g_e).sum(), (z, alpha))
    w0, ent0 = naive_gate(alpha, z, gamma)
    grads0 = torch.autograd.grad((w0 * g_w).sum() + (ent0 * g_e).sum(), (z, alpha))

    torch.testing.assert_close(w, w0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ent0, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, grads0):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_fused_binary_bits_are_exact() -> None:
    """Bits at exactly 0/1 give exact one-hot selectors and exactly zero gradients."""
    z = torch.tensor([[[2.0, -2.0, 2.0]], [[-0.1, 2.0, -3.0]]], dtype=F64, requires_grad=True)
    alpha = torch.zeros(2, 1, dtype=F64, requires_grad=True)
    w, ent = dispatch.dselect_k_fused(alpha, z, 1.0)
    assert w[0].tolist() == [0.0] * 5 + [1.0] + [0.0] * 2  # bits 1,0,1 -> expert 5
    assert ent[0].item() == 0.0
    (gz,) = torch.autograd.grad((w * torch.arange(8.0, dtype=F64)).sum() + ent.sum(), (z,))
    assert gz[0].abs().max().item() == 0.0
    assert gz[1, 0, 1:].abs().max().item() == 0.0 and gz[1, 0, 0].item() != 0.0


def test_fused_gradcheck() -> None:
    z, alpha = _inputs((4,), 2, 5, 0.4)
    gamma = torch.tensor(1.3, dtype=F64)
    assert torch.autograd.gradcheck(
        lambda a, zz: dispatch.dselect_k_fused(a, zz, gamma), (alpha, z)
    )


def test_fused_only_weights_or_only_entropy_used() -> None:
    z, alpha = _inputs((6,), 4, 4, 0.5)
    w, ent = dispatch.dselect_k_fused(alpha, z, 1.0)
    w0, ent0 = naive_gate(alpha, z, 1.0)
    for out, ref in ((w.sum(), w0.sum()), (ent.pow(2).sum(), ent0.pow(2).sum())):
        got = torch.autograd.grad(out, (z, alpha), retain_graph=True, allow_unused=True)
        want = torch.autograd.grad(ref, (z, alpha), retain_graph=True, allow_unused=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(
                a if a is not None else torch.zeros_like(b),
                b if b is not None else torch.zeros_like(a),
            )


def test_fused_float32_close_to_float64() -> None:
    z, alpha = _inputs((64,), 4, 7, 0.5)
    w64, _ = dispatch.dselect_k_fused(alpha, z, 1.0)
    w32, _ = dispatch.dselect_k_fused(alpha.float(), z.float(), 1.0)
    torch.testing.assert_close(w32.double(), w64, rtol=1e-5, atol=1e-6)


def test_gamma_requiring_grad_falls_back() -> None:
    z, alpha = _inputs((3,), 2, 3, 0.5)
    gamma = torch.tensor(0.8, dtype=F64, requires_grad=True)
    w, _ = dispatch.dselect_k_fused(alpha, z, gamma)
    (g,) = torch.autograd.grad(w[..., 0].sum(), (gamma,))
    assert torch.isfinite(g)


def test_dselect_k_weights_uses_same_numbers() -> None:
    z, alpha = _inputs((5,), 3, 4, 0.5)
    w = DF.dselect_k_weights(alpha, z, 0.7, num_experts=11)
    w0, _ = naive_gate(alpha, z, 0.7)
    torch.testing.assert_close(w, w0[..., :11])


@pytest.mark.parametrize("num_experts", [8, 11])
@pytest.mark.parametrize("per_example", [False, True])
@pytest.mark.parametrize("num_gates", [None, 3])
def test_gate_module_matches_naive(num_experts: int, per_example: bool, num_gates) -> None:
    torch.manual_seed(0)
    gate = DSelectKExtended(
        num_experts,
        2,
        in_features=5 if per_example else None,
        num_gates=num_gates,
        entropy_reg=0.3,
        xi=0.5,
        init="spread",
    ).double()
    x = torch.randn(7, 5, dtype=F64) if per_example else None
    out = gate(x)
    params = list(gate.parameters())
    g_w = torch.randn_like(out.weights)
    grads = torch.autograd.grad((out.weights * g_w).sum() + out.aux_loss, params)

    alpha, z = gate.split_logits(gate.compute_logits(x))
    w0, ent0 = naive_gate(alpha, z, gate.gamma)
    per_gate = 0.3 * ent0.sum(-1)
    if num_experts < 16:
        p = DF.smooth_step(z, gate.gamma)
        per_gate = per_gate + DF.unused_code_penalty(p, num_experts, 0.5).sum(-1)
    aux0 = per_gate.sum() if x is None else per_gate.sum() / x.shape[0]
    grads0 = torch.autograd.grad((w0[..., :num_experts] * g_w).sum() + aux0, params)
    torch.testing.assert_close(out.weights, w0[..., :num_experts])
    torch.testing.assert_close(out.aux_loss, aux0)
    for a, b in zip(grads, grads0):
        torch.testing.assert_close(a, b)


# -- conditional computation ---------------------------------------------------------------


def _binary_per_example_gate(num_gates: int | None, n: int = 8, k: int = 2) -> DSelectK:
    gate = DSelectKExtended(n, k, in_features=6, num_gates=num_gates, init="spread").double()
    with torch.no_grad():
        gate.proj.weight.mul_(300.0)  # |Wx| >> γ/2: S(Wx) binary for (almost) every example
    return gate


def _mtl(gates, conditional: bool) -> MultiGateMoE:
    torch.manual_seed(3)
    experts = StackedMLP(8, 6, [5], final_activation=True).double()
    towers = StackedMLP(2, 5, [4, 1], final_activation=False).double()
    return MultiGateMoE(experts, gates, towers, conditional=conditional)


@pytest.mark.parametrize("bank", [True, False])
def test_inference_dispatch_matches_dense(bank: bool) -> None:
    torch.manual_seed(0)
    gates = _binary_per_example_gate(2) if bank else [_binary_per_example_gate(None)] * 2
    fast = _mtl(gates, conditional=True).eval()
    dense = _mtl(gates, conditional=False).eval()
    dense.load_state_dict(fast.state_dict())
    x = torch.randn(64, 6, dtype=F64)
    weights = fast.gate_weights(x)[0]
    assert (weights != 0).sum(-1).double().mean() < 3  # mostly k = 2 experts per example
    assert fast.mixer.dispatch(x, weights) is not None
    with torch.no_grad():
        got, want = fast(x), dense(x)
    for a, b in zip(got.outputs, want.outputs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_inference_dispatch_single_gate_topk_and_dense_fallback() -> None:
    torch.manual_seed(0)
    experts = StackedMLP(8, 6, [5], final_activation=True).double()
    x = torch.randn(50, 6, dtype=F64)
    gate = TopKGate(8, 2, in_features=6).double()
    fast = MoE(experts, gate).eval()
    dense = MoE(experts, gate, conditional=False).eval()
    torch.testing.assert_close(fast(x).output, dense(x).output, rtol=1e-12, atol=1e-12)
    w = gate(x).weights.unsqueeze(1)
    torch.testing.assert_close(fast.mixer.dispatch(x, w)[0], dense(x).output)
    # dense weights (k = 8 of 8): the mixer declines to route
    assert fast.mixer.dispatch(x, torch.softmax(torch.randn(50, 1, 8, dtype=F64), -1)) is None


def test_dispatch_gradients_match_dense() -> None:
    """Routing is exact for gradients too (used only at inference, but it is differentiable)."""
    torch.manual_seed(0)
    gate = _binary_per_example_gate(2)
    fast, dense = _mtl(gate, True), _mtl(gate, False)
    dense.load_state_dict(fast.state_dict())
    x = torch.randn(40, 6, dtype=F64)
    w = fast.gate_weights(x)[0]
    out_fast = fast.mixer.dispatch(x, w)
    out_dense = fast.mixer.experts(x)
    out_dense = torch.bmm(w, out_dense.transpose(0, 1)).transpose(0, 1)
    params = list(fast.mixer.experts.parameters())
    g = torch.randn_like(out_dense)
    for a, b in zip(
        torch.autograd.grad((out_fast * g).sum(), params),
        torch.autograd.grad((out_dense * g).sum(), params),
    ):
        torch.testing.assert_close(a, b)


def test_static_binary_gates_skip_experts_with_same_gradients() -> None:
    torch.manual_seed(0)
    gate = DSelectK(8, 2, num_gates=2).double()
    with torch.no_grad():  # Z = ±γ: S(Z) binary; task 0 -> experts {1, 2}, task 1 -> {2, 5}
        codes = torch.tensor([[1, 2], [2, 5]])
        bits = (codes.unsqueeze(-1) >> torch.arange(3)) & 1
        gate.z.copy_((bits.double() * 2 - 1) * gate.gamma)
    assert bool(gate.is_binary().all())
    fast, dense = _mtl(gate, True).train(), _mtl(gate, False).train()
    dense.load_state_dict(fast.state_dict())
    x = torch.randn(32, 6, dtype=F64)
    calls: list[int] = []
    hook = fast.mixer.experts.register_forward_hook(
        lambda mod, args, out: calls.append(out.shape[0])
    )
    of, od = fast(x), dense(x)
    hook.remove()
    assert calls == [3]  # only experts 1, 2 and 5 computed
    lf = sum(o.sum() for o in of.outputs) + of.aux_loss
    ld = sum(o.sum() for o in od.outputs) + od.aux_loss
    gf = torch.autograd.grad(lf, list(fast.parameters()))
    gd = torch.autograd.grad(ld, list(dense.parameters()))
    for a, b in zip(gf, gd):
        torch.testing.assert_close(a, b)


def test_inference_dispatch_expert_list_loop_path() -> None:
    """Arbitrary expert modules (ExpertList) are routed one expert at a time."""
    from dselectk.layers import ExpertList

    torch.manual_seed(0)
    experts = ExpertList([nn.Sequential(nn.Linear(6, 5), nn.Tanh()) for _ in range(8)]).double()
    gate = _binary_per_example_gate(None)
    fast = MoE(experts, gate).eval()
    dense = MoE(experts, gate, conditional=False).eval()
    x = torch.randn(30, 6, dtype=F64)
    assert fast.mixer.dispatch(x, gate(x).weights.unsqueeze(1)) is not None
    with torch.no_grad():
        torch.testing.assert_close(fast(x).output, dense(x).output, rtol=1e-12, atol=1e-12)


def test_fused_gate_works_with_torch_func() -> None:
    """The fused node is a setup_context Function: torch.func.grad and vmap work through it."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    gate = DSelectK(8, 2, in_features=5, entropy_reg=0.2).double()
    x = torch.randn(6, 5, dtype=F64)
    params = dict(gate.named_parameters())

    def loss(p: dict, xb: torch.Tensor) -> torch.Tensor:
        out = functional_call(gate, p, (xb,))
        return (out.weights**2).sum() + out.aux_loss

    got = grad(loss)(params, x)
    want = torch.autograd.grad(loss(params, x), list(params.values()))
    for name, ref in zip(params, want):
        torch.testing.assert_close(got[name], ref)
    per_example = vmap(grad(lambda p, xi: loss(p, xi.unsqueeze(0))), in_dims=(None, 0))(params, x)
    for i in range(6):
        (ref,) = torch.autograd.grad(loss(params, x[i : i + 1]), [params["proj.weight"]])
        torch.testing.assert_close(per_example["proj.weight"][i], ref)
    z, alpha = _inputs((3, 4), 2, 3, 0.5)
    batched = vmap(lambda a, zz: dispatch.dselect_k_fused(a, zz, 1.0)[0])(alpha, z)
    torch.testing.assert_close(batched, dispatch.dselect_k_fused(alpha, z, 1.0)[0])
