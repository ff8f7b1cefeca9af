"""The token MoE block's grouped expert pass (autograd form) equals the experts evaluated one
member at a time on their rows, outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from dselectk.layers.experts import StackedMLP
from dselectk.layers.token_moe import SparseMoEFeedForward

F64 = torch.float64


def _grouped_mlp(mlp: StackedMLP, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The fast path under test (what the block calls)."""
    return mlp.forward_grouped(x, counts)


def _member_by_member(mlp: StackedMLP, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The oracle: member e's own forward on its block of rows, blocks concatenated."""
    parts, start = [], 0
    for e, c in enumerate(counts):
        if c:
            parts.append(mlp(x[start : start + c], torch.tensor([e]))[0])
        start += c
    return torch.cat(parts) if parts else x.new_zeros(0, mlp.out_features)


@pytest.mark.parametrize("counts", [[3, 0, 2, 4], [0, 0, 5, 0], [0, 0, 0, 0]])
@pytest.mark.parametrize("final_activation", [False, True])
def test_grouped_mlp_matches_forward_grouped(counts: list[int], final_activation: bool) -> None:
    torch.manual_seed(0)
    mlp = StackedMLP(4, 6, [5, 3], final_activation=final_activation).to(F64)
    x = torch.randn(sum(counts), 6, dtype=F64, requires_grad=True)
    got = _grouped_mlp(mlp, x, counts)
    if not sum(counts):  # no rows at all: an empty output, zero gradients
        torch.testing.assert_close(got, _member_by_member(mlp, x, counts))
        got.sum().backward()
        assert all(not p.grad.any() for p in mlp.parameters())
        return
    ref = _member_by_member(mlp, x, counts)
    torch.testing.assert_close(got, ref)
    g = torch.randn_like(ref)
    params = [x, *mlp.parameters()]
    for a, b in zip(
        torch.autograd.grad(got, params, g, allow_unused=True),
        torch.autograd.grad(_member_by_member(mlp, x, counts), params, g, allow_unused=True),
    ):
        if a is None or b is None:
            assert (a is None or not a.any()) and (b is None or not b.any())
        else:
            torch.testing.assert_close(a, b)
    with torch.no_grad():
        torch.testing.assert_close(_grouped_mlp(mlp, x, counts), ref)


def test_block_still_matches_dense_reference() -> None:
    torch.manual_seed(1)
    block = SparseMoEFeedForward(8, 16, 4, "topk", 2, balance_weight=0.0).to(F64)
    x = torch.randn(2, 5, 8, dtype=F64, requires_grad=True)
    out = block(x).output
    torch.testing.assert_close(out, block.dense_reference(x))
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("experts", ["stacked", "gated"])
def test_no_grad_pass_equals_the_autograd_pass_bit_for_bit(experts: str) -> None:
    """Without autograd the experts and the combine skip their autograd nodes; the numbers
    must be those of the tracked pass exactly, for the grouped experts and the whole block."""
    from dselectk.layers.experts import GatedMLP

    torch.manual_seed(0)
    mlp = StackedMLP(4, 6, [5, 3]) if experts == "stacked" else GatedMLP(4, 6, 5, 3)
    counts = [3, 0, 2, 4]
    x = torch.randn(sum(counts), 6)
    tracked = mlp.forward_grouped(x, counts)
    assert tracked.grad_fn is not None
    with torch.no_grad():
        plain = mlp.forward_grouped(x, counts)
    assert plain.grad_fn is None and torch.equal(plain, tracked)

    gated = experts == "gated"
    # a zero weight among a token's k largest dispatches nothing; a capacity drops pairs
    for gate, capacity in (("topk", None), ("topk", 0.5), ("dselect_k", None)):
        block = SparseMoEFeedForward(
            6, 10, 4, gate, 2, capacity_factor=capacity, gated=gated, balance_weight=0.1
        )
        if gate == "dselect_k":  # saturated selectors: every token's weight on one expert
            with torch.no_grad():
                block.gate.proj.weight.zero_()
                block.gate.proj.bias.fill_(10.0)
        tokens = torch.randn(3, 5, 6)
        want = block(tokens)
        if gate == "dselect_k":
            assert sum(block.last_stats["load"].tolist()) == 15  # the 15 zero pairs dropped
        with torch.inference_mode():
            got = block(tokens)
        assert want.output.grad_fn is not None
        assert torch.equal(got.output, want.output) and torch.equal(got.aux_loss, want.aux_loss)
