"""Expert-choice routing in :class:`SparseMoEFeedForward` (``routing="expert"``): every expert
takes exactly its capacity of tokens, the largest weights win, the output is the dense mixture
under the chosen mask, gradients reach router and experts, and bad settings are refused."""

from __future__ import annotations

import math

import pytest
import torch

from dselectk.layers import SparseMoEFeedForward


def _block(k: int = 2, n: int = 4, factor: float | None = None) -> SparseMoEFeedForward:
    torch.manual_seed(0)
    return SparseMoEFeedForward(
        8, 16, n, "softmax", k=k, routing="expert", capacity_factor=factor,
        balance_weight=0.0,
    )  # fmt: skip


CASES = [(12, 2, 4, None), (10, 1, 4, None), (7, 2, 4, 1.5), (3, 2, 2, 4.0)]


@pytest.mark.parametrize(("tokens", "k", "n", "factor"), CASES)
def test_every_expert_takes_its_capacity_of_largest_weights(tokens, k, n, factor) -> None:
    moe = _block(k, n, factor)
    x = torch.randn(tokens, 8)
    r = moe.route(x)
    cap = min(tokens, math.ceil((factor or 1.0) * tokens * k / n))
    assert moe.capacity(tokens) == cap
    assert r.counts == [cap] * n and r.dropped == 0
    assert torch.equal(r.expert, torch.arange(n).repeat_interleave(cap))
    for e in range(n):
        chosen = set(r.token[r.expert == e].tolist())
        assert len(chosen) == cap
        col = r.weights[:, e]
        threshold = col[list(chosen)].min()
        others = [t for t in range(tokens) if t not in chosen]
        assert all(col[t] <= threshold for t in others)  # the largest weights were taken
    assert torch.allclose(r.pair_weight, r.weights[r.token, r.expert])


def test_output_is_the_masked_dense_mixture_and_gradients_flow() -> None:
    moe = _block()
    x = torch.randn(2, 6, 8, requires_grad=True)
    out = moe(x)
    flat = x.reshape(-1, 8)
    r = moe.route(flat)
    mask = torch.zeros_like(r.weights)
    mask[r.token, r.expert] = 1.0
    every = moe.experts(flat)  # (n, N, d)
    want = torch.einsum("tn,ntd->td", r.weights * mask, every).reshape(x.shape)
    assert torch.allclose(out.output, want, atol=1e-6)
    out.output.square().sum().backward()
    assert x.grad is not None
    assert all(p.grad is not None for p in moe.gate.parameters())
    assert all(p.grad is not None for p in moe.experts.parameters())


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="routing"):
        SparseMoEFeedForward(8, 16, 4, "softmax", routing="tokens")
    with pytest.raises(ValueError, match="renormalize"):
        SparseMoEFeedForward(8, 16, 4, "softmax", routing="expert", renormalize=True)
