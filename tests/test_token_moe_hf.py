"""SwiGLU experts host a Hugging Face MoE block exactly; the fast path equals the reference.

``SparseMoEFeedForward.from_hf_block`` loads the router and the fused experts of tiny
transformers blocks (Mixtral, OLMoE with and without ``norm_topk_prob``, Qwen2-MoE's routed
part) and must give their outputs and gradients to rounding in float64. The sparse path (gather,
grouped matmuls, weighted scatter-add) must equal :meth:`SparseMoEFeedForward.reference`, every
expert on every token masked by the routing, outputs and gradients, for every expert kind.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dselectk.gates import SoftmaxGate, TopKGate
from dselectk.layers import GatedMLP, SparseMoEFeedForward, grouped_linear

F64 = torch.float64
D, FF, N_EXP, K = 12, 10, 6, 2


def _init(block: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block.to(F64).eval()


def _mixtral() -> nn.Module:
    tr = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = tr.MixtralConfig(
        hidden_size=D, intermediate_size=FF, num_local_experts=N_EXP, num_experts_per_tok=K
    )
    return _init(MixtralSparseMoeBlock(cfg))


def _olmoe(norm: bool) -> nn.Module:
    tr = pytest.importorskip("transformers")
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    cfg = tr.OlmoeConfig(
        hidden_size=D,
        intermediate_size=FF,
        num_experts=N_EXP,
        num_experts_per_tok=K,
        norm_topk_prob=norm,
    )
    return _init(OlmoeSparseMoeBlock(cfg))


def _qwen2() -> nn.Module:
    tr = pytest.importorskip("transformers")
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = tr.Qwen2MoeConfig(
        hidden_size=D,
        moe_intermediate_size=FF,
        shared_expert_intermediate_size=8,
        num_experts=N_EXP,
        num_experts_per_tok=K,
        norm_topk_prob=False,
    )
    return _init(Qwen2MoeSparseMoeBlock(cfg))


# transformers' routers take the softmax in float32 whatever the model's dtype (``.float()``,
# ``dtype=torch.float``), so their routing weights carry float32 rounding: outputs agree to
# float32's precision (a router weight off by eps_32 ≈ 1.2e-7 relative), not float64's.
# Gradients pass back through that float32 softmax too.
TOL = dict(rtol=2e-6, atol=1e-7)
GTOL = dict(rtol=1e-5, atol=1e-6)


def _check_same(block: nn.Module, ours: SparseMoEFeedForward, extra: object = None) -> None:
    """Outputs and gradients of ``block`` and ``ours`` (+ ``extra(x)``) agree."""
    torch.manual_seed(1)
    x = torch.randn(2, 9, D, dtype=F64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    theirs = block(xa)
    mine = ours(xb).output
    if callable(extra):
        mine = mine + extra(xb)
    torch.testing.assert_close(mine, theirs, **TOL)
    assert not torch.equal(mine, torch.zeros_like(mine))
    g = torch.randn_like(theirs)
    theirs.backward(g)
    mine.backward(g)
    torch.testing.assert_close(xb.grad, xa.grad, **GTOL)
    # expert weight gradients, mapped back to transformers' layout
    assert isinstance(ours.experts, GatedMLP)
    hf = block.experts
    torch.testing.assert_close(
        ours.experts.gate_up.grad.transpose(1, 2), hf.gate_up_proj.grad, **GTOL
    )
    torch.testing.assert_close(ours.experts.down.grad.transpose(1, 2), hf.down_proj.grad, **GTOL)
    torch.testing.assert_close(ours.gate.proj.weight.grad, block.gate.weight.grad, **GTOL)


def test_mixtral_block_is_hosted_exactly() -> None:
    block = _mixtral()
    ours = SparseMoEFeedForward.from_hf_block(block, balance_weight=0.0)
    assert isinstance(ours.gate, TopKGate) and ours.gate.proj.bias is None
    assert ours.gated and ours.k == K and ours.experts.activation == "silu"
    assert ours.experts.gate_up.dtype == F64
    _check_same(block, ours)


@pytest.mark.parametrize("norm", [False, True])
def test_olmoe_block_is_hosted_exactly(norm: bool) -> None:
    block = _olmoe(norm)
    ours = SparseMoEFeedForward.from_hf_block(block, balance_weight=0.0)
    assert isinstance(ours.gate, TopKGate if norm else SoftmaxGate)
    _check_same(block, ours)


def test_qwen2_moe_routed_experts_plus_its_shared_expert() -> None:
    block = _qwen2()
    ours = SparseMoEFeedForward.from_hf_block(block, balance_weight=0.0)

    def shared(x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)

    _check_same(block, ours, shared)


def test_hosted_weights_by_hand() -> None:
    """The layout: expert e's output is down_e(silu(gate_e x) * up_e x), HF's row order."""
    block = _mixtral()
    ours = SparseMoEFeedForward.from_hf_block(block)
    x = torch.randn(5, D, dtype=F64)
    gu, dn = block.experts.gate_up_proj, block.experts.down_proj
    with torch.no_grad():
        every = ours.experts(x)  # (E, 5, D)
        for e in range(N_EXP):
            gate, up = (x @ gu[e].t()).chunk(2, dim=-1)
            ref = (torch.nn.functional.silu(gate) * up) @ dn[e].t()
            torch.testing.assert_close(every[e], ref, rtol=1e-12, atol=1e-12)


def test_from_hf_block_refuses_what_it_cannot_host() -> None:
    with pytest.raises(TypeError, match=r"gate\.weight"):
        SparseMoEFeedForward.from_hf_block(nn.Linear(3, 3))
    block = _mixtral()
    with pytest.raises(ValueError, match="gate is taken from the block"):
        SparseMoEFeedForward.from_hf_block(block, gate="dselect_k")
    block.experts.act_fn = nn.GELU(approximate="tanh")
    with pytest.raises(ValueError, match="activation GELU"):
        SparseMoEFeedForward.from_hf_block(block)


def test_load_fused_checks_shapes() -> None:
    bank = GatedMLP(3, 4, 5)
    with pytest.raises(ValueError, match=r"gate_up_proj must be \(3, 10, 4\)"):
        bank.load_fused(torch.zeros(3, 5, 4), torch.zeros(3, 4, 5))
    with pytest.raises(ValueError, match=r"down_proj must be \(3, 4, 5\)"):
        bank.load_fused(torch.zeros(3, 10, 4), torch.zeros(3, 5, 4))


# -- the fast path against the reference --------------------------------------------------------
CASES = [
    dict(gate="topk", gated=False),
    dict(gate="topk", gated=True, activation="silu"),
    dict(gate="softmax", gated=True, activation="gelu", renormalize=True),
    dict(gate="topk", gated=False, capacity_factor=0.6),
    dict(gate="softmax", gated=True, activation="silu", routing="expert"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_fast_path_equals_reference_outputs_and_gradients(case: dict) -> None:
    torch.manual_seed(2)
    block = SparseMoEFeedForward(D, FF, N_EXP, k=K, balance_weight=0.0, **case).to(F64)
    x = torch.randn(3, 11, D, dtype=F64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    fast = block(xa).output
    params = list(block.parameters())
    g = torch.randn_like(fast)
    got = torch.autograd.grad(fast, [xa, *params], g)
    ref = block.reference(xb)
    want = torch.autograd.grad(ref, [xb, *params], g)
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if case.get("capacity_factor"):
        assert block.last_stats is not None and block.last_stats["dropped"] > 0


def test_reference_is_not_the_unmasked_mixture() -> None:
    """The oracle masks: with a dense softmax router it differs from Σ_i w_i E_i(x)."""
    torch.manual_seed(3)
    block = SparseMoEFeedForward(D, FF, N_EXP, "softmax", k=K).to(F64)
    x = torch.randn(7, D, dtype=F64)
    with torch.no_grad():
        assert not torch.allclose(block.reference(x), block.dense_reference(x))
        torch.testing.assert_close(block(x).output, block.reference(x))


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_by_hand_and_empty_members(bias: bool) -> None:
    torch.manual_seed(4)
    w = torch.randn(4, 3, 5, dtype=F64, requires_grad=True)
    b = torch.randn(4, 5, dtype=F64, requires_grad=True) if bias else None
    counts = [2, 0, 3, 1]
    x = torch.randn(6, 3, dtype=F64, requires_grad=True)
    y = grouped_linear(x, w, b, counts)
    member = torch.tensor([0, 0, 2, 2, 2, 3])
    ref = torch.einsum("ra,rab->rb", x, w[member]) + (b[member] if b is not None else 0)
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    inputs = [x, w] + ([b] if b is not None else [])
    for a, c in zip(torch.autograd.grad(y, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(a, c)
    gw = torch.autograd.grad(grouped_linear(x, w, b, counts), w, g)[0]
    assert not gw[1].any()  # the member without rows
    with pytest.raises(ValueError, match="counts must have 4 entries"):
        grouped_linear(x, w, b, [6])
    with pytest.raises(ValueError, match=r"x must be \(sum\(counts\)=5, 3\)"):
        grouped_linear(x, w, b, [2, 0, 2, 1])
    with pytest.raises(ValueError, match="counts must be >= 0"):
        grouped_linear(x, w, b, [7, -1, 0, 0])
