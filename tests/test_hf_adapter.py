"""DSelect-k routers in Hugging Face Mixtral MoE blocks (tiny models from a config; no download)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")

from dselectk.gates import DSelectK  # noqa: E402
from dselectk.integrations.hf import (  # noqa: E402
    GateRouter,
    find_moe_blocks,
    replace_routers,
    router_aux_loss,
)

N_EXPERTS, TOP_K, HIDDEN = 4, 2, 16


def _model(dtype: torch.dtype = torch.float32, **kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=50,
        hidden_size=HIDDEN,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=N_EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=32,
        **kw,
    )
    return transformers.MixtralForCausalLM(cfg).to(dtype)


def test_forward_backward_router_logits_and_aux_loss() -> None:
    model = _model(output_router_logits=True, router_aux_loss_coef=0.02)
    routers = replace_routers(model, "dselect_k", entropy_reg=0.5, aux_loss_weight=1.0)
    assert len(routers) == 2 and all(isinstance(r, GateRouter) for r in routers)
    assert all(isinstance(r, mixtral.MixtralTopKRouter) for r in routers)
    ids = torch.randint(0, 50, (2, 7))
    out = model(input_ids=ids, labels=ids)
    # router logits are recorded (one per layer) and are log-weights
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (14, N_EXPERTS)
    probs = out.router_logits[0].softmax(-1)
    assert torch.allclose(probs.sum(-1), torch.ones(14))
    # the loss = CE + coef * balancing + the gates' aux (entropy)
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 50), ids[:, 1:].flatten())
    gate_aux = router_aux_loss(model)
    assert float(gate_aux.detach()) > 0
    expected = ce + 0.02 * out.aux_loss + gate_aux
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    for r in routers:
        grads = [p.grad for p in r.parameters()]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.grad is not None


def test_balancing_loss_matches_normalised_weights() -> None:
    model = _model(output_router_logits=True)
    (router,) = replace_routers(model, "topk", aux_loss_weight=0.0)[:1]
    x = torch.randn(9, HIDDEN)
    logits, top_w, top_i = router(x)
    w = router.gate_module(x).weights
    torch.testing.assert_close(logits.softmax(-1), w / w.sum(-1, keepdim=True))
    torch.testing.assert_close(top_w, w.gather(-1, top_i))
    hf = mixtral.load_balancing_loss_func((logits,), N_EXPERTS, TOP_K)
    f = torch.bincount(top_i.flatten(), minlength=N_EXPERTS).float() / 9
    torch.testing.assert_close(hf, N_EXPERTS * (f * w.mean(0)).sum())


def test_binary_block_equals_dense_mixture() -> None:
    model = _model(torch.float64, experts_implementation="eager")
    replace_routers(model, "dselect_k")
    _, block = find_moe_blocks(model)[0]
    gate: DSelectK = block.gate.gate_module
    with torch.no_grad():
        gate.proj.weight.mul_(1e4)
        gate.proj.bias.mul_(1e4)
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    assert gate.binary_fraction(x) == 1.0
    out = block(x.clone())
    w = gate(x).weights  # (2, 5, n)
    ex = block.experts
    dense = torch.zeros_like(x)
    for i in range(N_EXPERTS):
        g, u = torch.nn.functional.linear(x, ex.gate_up_proj[i]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(ex.act_fn(g) * u, ex.down_proj[i])
        dense = dense + w[..., i : i + 1] * y
    torch.testing.assert_close(out, dense, rtol=0, atol=1e-10)


def test_generate_and_errors() -> None:
    model = _model()
    replace_routers(model, "dselect_k", gamma=2.0)
    model.eval()
    ids = torch.randint(0, 50, (1, 4))
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert gen.shape == (1, 7)
    with pytest.raises(ValueError, match="no Mixtral-style"):
        replace_routers(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="per-example"):
        replace_routers(_model(), lambda n, d, k: DSelectK(n, k))
