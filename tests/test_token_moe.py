"""Per-token routing: gates on (..., d) tokens and the sparse MoE feed-forward block."""

from __future__ import annotations

import math

import pytest
import torch

from dselectk.gates import DSelectK, TopKGate, gate_names, make_gate
from dselectk.layers import SparseMoEFeedForward, balance_loss

D = 6


def _gate(name: str, **kw: object) -> torch.nn.Module:
    extra = (
        {"k": 2}
        if name
        in (
            "dselect_k",
            "dselect_k_extended",
            "topk",
            "ablation_entropy",
            "ablation_annealing",
            "comet",
        )
        else {}
    )
    return make_gate(name, 5, in_features=D, **extra, **kw)


# -- gates on tokens ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", gate_names())
def test_gates_accept_tokens(name: str) -> None:
    torch.manual_seed(0)
    gate = _gate(name).eval()
    x = torch.randn(3, 4, D)
    out = gate(x)
    assert out.weights.shape == (3, 4, 5)
    flat = gate(x.reshape(12, D))
    torch.testing.assert_close(out.weights.reshape(12, 5), flat.weights, rtol=0, atol=0)
    torch.testing.assert_close(out.aux_loss, flat.aux_loss, rtol=0, atol=0)
    assert gate(torch.randn(2, 3, 4, D)).weights.shape == (2, 3, 4, 5)


def test_gate_bank_on_tokens_and_errors() -> None:
    gate = DSelectK(5, 2, in_features=D, num_gates=3)
    assert gate(torch.randn(2, 7, D)).weights.shape == (2, 7, 3, 5)
    with pytest.raises(ValueError, match=r"shape \(batch, 6\)"):
        gate(torch.randn(2, 7, D + 1))
    with pytest.raises(ValueError, match=r"shape \(batch, 6\)"):
        gate(torch.randn(D))
    assert gate.bits(torch.randn(2, 7, D)).shape == (14, 3, 2, 3)  # flattened tokens


# -- the block -----------------------------------------------------------------------------------
def _binary_dselect(block: SparseMoEFeedForward) -> None:
    """Scale the router so that S(Wx) is binary on every token (≤ k experts)."""
    with torch.no_grad():
        block.gate.proj.weight.mul_(1e4)
        block.gate.proj.bias.mul_(1e4)


@pytest.mark.parametrize("router", ["topk", "dselect_k"])
def test_block_equals_dense_mixture(router: str) -> None:
    torch.manual_seed(1)
    block = SparseMoEFeedForward(D, 8, 4, router, k=2, selectors=None, renormalize=False).double()
    if router == "dselect_k":
        _binary_dselect(block)
    x = torch.randn(3, 5, D, dtype=torch.float64)
    out, aux = block(x)
    assert out.shape == x.shape and aux.dim() == 0
    torch.testing.assert_close(out, block.dense_reference(x), rtol=0, atol=1e-12)
    assert block.last_stats is not None and block.last_stats["dropped"] == 0
    if router == "dselect_k":
        assert block.gate.binary_fraction(x.reshape(-1, D)) == 1.0
    # the sparse path evaluates each token on <= k experts
    assert int(block.last_stats["load"].sum()) <= 2 * 15


def test_nonbinary_dselect_keeps_top_k() -> None:
    torch.manual_seed(2)
    block = SparseMoEFeedForward(D, 8, 8, "dselect_k", k=2, renormalize=True).double()
    x = torch.randn(10, D, dtype=torch.float64)
    out, _ = block(x)
    w = block.gate(x).weights
    top_w, top_e = w.topk(2, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    every = block.experts(x)  # (n, N, d)
    ref = sum(top_w[:, j, None] * every[top_e[:, j], torch.arange(10)] for j in range(2))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert int(block.last_stats["load"].sum()) == 20


@pytest.mark.parametrize("router", ["topk", "dselect_k", "softmax"])
def test_gradients_reach_router_and_experts(router: str) -> None:
    torch.manual_seed(3)
    kw = {"entropy_reg": 0.1} if router == "dselect_k" else None
    block = SparseMoEFeedForward(
        D, 8, 4, router, k=2, selectors=None, renormalize=False, gate_kwargs=kw
    )
    out, aux = block(torch.randn(2, 6, D))
    (out.square().mean() + aux).backward()
    for name, p in block.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if name.startswith("router"):
            assert p.grad.abs().sum() > 0, name
    assert sum(float(p.grad.abs().sum()) for p in block.experts.parameters()) > 0


def test_capacity_drops_are_counted() -> None:
    torch.manual_seed(4)
    router = TopKGate(4, 1, in_features=D)
    with torch.no_grad():  # every token prefers expert 2
        router.proj.weight.zero_()
        router.proj.bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    block = SparseMoEFeedForward(
        D, 8, 4, router, k=1, selectors=None, renormalize=False, capacity_factor=1.0
    ).double()
    x = torch.randn(16, D, dtype=torch.float64)
    out, _ = block(x)
    cap = block.capacity(16)
    assert cap == 4
    stats = block.last_stats
    assert stats["dropped"] == 12 and stats["load"].tolist() == [0, 0, 4, 0]
    assert stats["routed"].tolist() == [0, 0, 16, 0]
    # the first `cap` tokens (token order) are kept, the rest get no expert output
    ref = block.dense_reference(x)
    torch.testing.assert_close(out[:4], ref[:4], rtol=0, atol=1e-12)
    assert torch.all(out[4:] == 0)


def test_capacity_priority_first_choices() -> None:
    router = TopKGate(2, 2, in_features=D)
    with torch.no_grad():
        router.proj.weight.zero_()
        router.proj.bias.copy_(torch.tensor([1.0, 0.0]))  # first choice 0, second 1
    block = SparseMoEFeedForward(
        D, 4, 2, router, k=2, selectors=None, renormalize=False, capacity_factor=0.5
    )
    block(torch.randn(8, D))
    # capacity ceil(0.5 * 8 * 2 / 2) = 4 per expert: 4 first choices kept on 0, 4 seconds on 1
    assert block.last_stats["load"].tolist() == [4, 4] and block.last_stats["dropped"] == 8


def test_balance_loss_by_hand() -> None:
    w = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 2.0, 2.0]])
    routed = torch.tensor([2, 1, 1, 1])
    # P = mean of normalised rows = [(0.5+1+0)/3, 0.5/3, 0.5/3, 0.5/3]; f = [2, 1, 1, 1] / 5
    p = [1.5 / 3, 0.5 / 3, 0.5 / 3, 0.5 / 3]
    f = [0.4, 0.2, 0.2, 0.2]
    expected = 4 * sum(a * b for a, b in zip(f, p))
    assert math.isclose(float(balance_loss(w, routed)), expected, rel_tol=1e-6)
    # uniform routing, uniform probabilities: 1
    assert math.isclose(float(balance_loss(torch.full((5, 4), 0.25), torch.ones(4))), 1.0)


def test_block_aux_is_gate_aux_plus_balance() -> None:
    torch.manual_seed(5)
    block = SparseMoEFeedForward(
        D, 8, 4, "dselect_k", k=2, selectors=None, renormalize=False, balance_weight=0.3,
        gate_kwargs={"entropy_reg": 0.2},
    )  # fmt: skip
    x = torch.randn(2, 5, D)
    _, aux = block(x)
    r = block.route(x.reshape(-1, D))
    expected = r.gate_aux + 0.3 * balance_loss(r.weights, r.routed)
    torch.testing.assert_close(aux, expected)
    assert float(r.gate_aux.detach()) > 0


def test_block_arguments() -> None:
    with pytest.raises(ValueError, match="per-example"):
        SparseMoEFeedForward(D, 8, 4, DSelectK(4, 2), k=2)
    with pytest.raises(ValueError, match="experts"):
        SparseMoEFeedForward(D, 8, 4, DSelectK(5, 2, in_features=D), k=2)
    with pytest.raises(ValueError, match="capacity_factor"):
        SparseMoEFeedForward(D, 8, 4, "topk", k=2, capacity_factor=0.0)
    with pytest.raises(ValueError, match="k must be"):
        SparseMoEFeedForward(D, 8, 4, "topk", k=5)
    block = SparseMoEFeedForward(D, 8, 4, "softmax", k=2)  # a gate without k
    assert block(torch.randn(3, D)).output.shape == (3, D)
    with pytest.raises(ValueError, match=r"\(\.\.\., 6\)"):
        block(torch.randn(3, D + 1))


@pytest.mark.parametrize("router", ["dselect_k", "topk"])
def test_nan_token_gives_nan_not_zeros_and_zero_tokens_work(router: str) -> None:
    from dselectk.layers import SparseMoEFeedForward

    torch.manual_seed(0)
    moe = SparseMoEFeedForward(16, 32, 4, gate=router, k=2, selectors=None, renormalize=False)
    x = torch.randn(3, 16)
    x[1, 0] = float("nan")
    out = moe(x).output
    assert bool(out[1].isnan().all())  # it used to be exact zeros: a silent wrong result
    assert bool(torch.isfinite(out[[0, 2]]).all())
    torch.testing.assert_close(out[[0, 2]], moe(x[[0, 2]]).output)
    empty = torch.zeros(0, 16, requires_grad=True)
    res = moe(empty)
    assert res.output.shape == (0, 16)
    res.output.sum().backward()  # zero tokens: no crash, forward or backward


def test_readme_late_binarization_recipe_trains_soft_then_ends_binary() -> None:
    """The README's recipe for an exactly sparse per-token router: distinct codes, λ held at 0
    for half the steps and then ramped to 0.1 by an AttributeScheduler, renormalised top-k
    cut. λ follows the ramp, and a token's nonzero weights are at most k, on k distinct
    experts, once its bits are binary."""
    from dselectk.schedules import AttributeScheduler
    from dselectk.variants import Ramp

    torch.manual_seed(0)
    steps = 40
    layer = SparseMoEFeedForward(
        8, 16, 8, gate="dselect_k", k=2, selectors=None, renormalize=True,
        gate_kwargs={"distinct": True, "entropy_reg": 0.0},
    )  # fmt: skip
    ramp = Ramp("entropy_reg", end=0.1, delay=0.5, before=0.0).schedule(0.0, steps)
    sched = AttributeScheduler([layer.gate], "entropy_reg", ramp)
    opt = torch.optim.Adam(layer.parameters(), lr=0.05)
    x, lam = torch.randn(64, 8), []
    for _ in range(steps):
        lam.append(float(layer.gate.entropy_reg))
        out = layer(x)
        ((out.output - x.flip(0)) ** 2).mean().add(out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert lam[:21] == [0.0] * 21 and lam[-1] == pytest.approx(0.1 * 19 / 20)
    assert float(layer.gate.entropy_reg) == pytest.approx(0.1)
    w = layer.gate(x).weights.detach()  # (tokens, n)
    binary = layer.gate.binary_entries(x).all(-1)  # (tokens,)
    assert binary.any()  # λ = 0.1 at the end binarizes some tokens within 40 steps
    assert ((w[binary] > 0).sum(-1) == 2).all()  # distinct codes: exactly 2 experts each


def test_readme_three_selector_recipe_dispatches_two_learned_experts() -> None:
    """The README's per-token recipe that met issue 23's bar (research/notes/per_token.md §4q): a
    DSelect-k router with three selectors (selectors=3, λ = 0: the defaults) under the layer's
    renormalised top-2 cut. Every token goes to exactly 2 experts, the two its mixture weights
    most, with those weights rescaled to sum to 1 (the block equals that masked mixture of all
    experts); where all three selectors end binary on one code, the token gets that one expert."""
    torch.manual_seed(0)
    layer = SparseMoEFeedForward(
        8, 16, 8, gate="dselect_k", k=2, selectors=3, renormalize=True,
        gate_kwargs={"entropy_reg": 0.0},
    )  # fmt: skip
    default = SparseMoEFeedForward(8, 16, 8)  # the defaults are this recipe
    assert isinstance(default.gate, DSelectK) and default.gate.k == 3 and default.k == 2
    assert default.renormalize and default.balance_weight == 0.01
    assert float(default.gate.entropy_reg) == 0.0
    assert layer.gate.k == 3 and layer.k == 2
    x = torch.randn(200, 8)
    out = layer(x)
    assert layer.last_stats is not None and int(layer.last_stats["load"].sum()) == 2 * 200
    w = layer.gate(x).weights.detach()
    assert ((w > 0).sum(-1) > 2).all()  # soft at initialisation: the cut picks the two
    top = w.topk(2, dim=-1)  # the mixture's two largest weights, rescaled to sum to 1
    kept = torch.zeros_like(w).scatter(-1, top.indices, top.values)
    kept = kept / kept.sum(-1, keepdim=True)
    every = layer.experts(x)  # (n, tokens, d): each expert on each token
    ref = torch.einsum("tn,ntd->td", kept, every)
    torch.testing.assert_close(out.output, ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # all three selectors binary on one code for every token
        layer.gate.proj.weight.zero_()
        layer.gate.proj.bias.copy_(torch.tensor([0.0, 0.0, 0.0] + [5.0, -5.0, 5.0] * 3))
    layer(x)
    assert layer.last_stats is not None and int(layer.last_stats["load"].sum()) == 200
    assert int(layer.last_stats["load"][0b101]) == 200


def test_old_keyword_names_get_a_type_error_naming_the_new_one() -> None:
    for old, new in (("router", "gate="), ("router_kwargs", "gate_kwargs="),
                     ("balance_loss_weight", "balance_weight=")):  # fmt: skip
        with pytest.raises(TypeError, match=f"{old}= is now {new}"):
            SparseMoEFeedForward(D, 8, 4, **{old: 0})
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        SparseMoEFeedForward(D, 8, 4, bogus=1)
    with pytest.raises(TypeError, match="selectors="):
        SparseMoEFeedForward(D, 8, 4, gate_kwargs={"k": 3})
    with pytest.raises(ValueError, match="selectors"):
        SparseMoEFeedForward(D, 8, 4, selectors=0)


def test_selectors_size_selector_gates_and_k_sizes_topk() -> None:
    assert SparseMoEFeedForward(D, 8, 4, "dselect_k", k=2, selectors=None).gate.k == 2
    assert SparseMoEFeedForward(D, 8, 4, "dselect_k", k=1, selectors=4).gate.k == 4
    assert SparseMoEFeedForward(D, 8, 4, "topk", k=1, selectors=3).gate.k == 1
    assert SparseMoEFeedForward(D, 8, 4, "comet", k=2).gate.k == 3
    ec = SparseMoEFeedForward(D, 8, 4, "softmax", routing="expert")
    assert not ec.renormalize  # None: renormalised for token routing only


def test_gate_attribute_and_states_saved_under_router_load(tmp_path: object) -> None:
    from pathlib import Path

    torch.manual_seed(0)
    layer = SparseMoEFeedForward(D, 8, 4, "dselect_k", k=2)
    assert isinstance(layer.gate, DSelectK)
    state = layer.state_dict()
    assert any(k.startswith("gate.") for k in state) and not any("router" in k for k in state)
    assert next(iter(state)).startswith("gate.")  # registered before the experts, as it was
    with pytest.raises(AttributeError, match=r"\.router is now \.gate"):
        layer.router  # noqa: B018
    # a state (and a file) written when the attribute was ``router``: keys router.*
    old = {k.replace("gate.", "router.", 1) if k.startswith("gate.") else k: v
           for k, v in state.items()}  # fmt: skip
    path = Path(str(tmp_path)) / "old.pt"
    torch.save(old, path)
    x = torch.randn(2, 5, D)
    for saved in (old, torch.load(path)):
        torch.manual_seed(1)
        fresh = SparseMoEFeedForward(D, 8, 4, "dselect_k", k=2)
        res = fresh.load_state_dict(saved, strict=True)
        assert not res.missing_keys and not res.unexpected_keys
        for a, b in zip(fresh.state_dict().values(), state.values()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(fresh(x).output, layer(x).output, rtol=0, atol=0)
    assert set(old) == {k.replace("gate.", "router.", 1) if k.startswith("gate.") else k
                        for k in state}  # the caller's dict is left as it was  # fmt: skip
    # nested in a model (the keys carry the layer's prefix)
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Identity(), SparseMoEFeedForward(D, 8, 4, "topk", k=2))
    nested = {k.replace("1.gate.", "1.router."): v for k, v in model.state_dict().items()}
    assert any(k.startswith("1.router.") for k in nested)
    torch.manual_seed(3)
    again = torch.nn.Sequential(torch.nn.Identity(), SparseMoEFeedForward(D, 8, 4, "topk", k=2))
    again.load_state_dict(nested)
    torch.testing.assert_close(again(x).output, model(x).output, rtol=0, atol=0)
    # a state holding both names is not guessed at: router.* are unexpected keys
    both = {**state, **{k.replace("gate.", "router.", 1): v for k, v in state.items()
                        if k.startswith("gate.")}}  # fmt: skip
    with pytest.raises(RuntimeError, match=r"Unexpected key.*router"):
        SparseMoEFeedForward(D, 8, 4, "dselect_k", k=2).load_state_dict(both)
