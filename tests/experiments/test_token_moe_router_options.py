"""Token-MoE router options (issue 23 screens): a nonlinear selector input (``router_hidden``),
a separate learning rate for the routers (``router_lr_scale``) and a capacity limit
(``capacity_factor``); all off by default, and a default command's records keep their
identity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dselectk.cli import main
from dselectk.experiments import token_moe as TM
from dselectk.experiments.token_moe.model import make_optimizer_for
from dselectk.experiments.token_moe.recipe import LATER, TokenMoEConfig
from dselectk.gates import make_gate
from dselectk.layers import SparseMoEFeedForward
from dselectk.models.char_lm import evaluate

#: the settings every record stored before the router options existed
_RECORD_KEYS = {
    "balance_loss_weight", "batch_size", "corpus_bytes", "d_ff", "d_model", "entropy_reg",
    "gamma", "heads", "k", "layers", "lr", "num_experts", "renormalize", "seq_len", "steps",
    "val_fraction", "val_windows",
}  # fmt: skip
_TINY = dict(d_model=16, d_ff=16, heads=2, num_experts=4, seq_len=8)


# -- the layer ----------------------------------------------------------------------------------
def test_router_hidden_off_by_default_keeps_the_modules() -> None:
    torch.manual_seed(0)
    moe = SparseMoEFeedForward(8, 16, 4, "topk", k=2)
    assert moe.router_input is None and moe.router_hidden == 0
    assert not any(k.startswith("router_input") for k in moe.state_dict())
    assert moe.router_parameters() == list(moe.router.parameters())
    x = torch.randn(5, 8)
    torch.testing.assert_close(moe.router_features(x), x, rtol=0, atol=0)


@pytest.mark.parametrize("router", ["topk", "dselect_k"])
def test_router_hidden_feeds_the_router_a_gelu_layer(router: str) -> None:
    torch.manual_seed(0)
    moe = SparseMoEFeedForward(8, 16, 4, router, k=2, router_hidden=12)
    assert moe.router.in_features == 12 and "router_hidden=12" in repr(moe)
    x = torch.randn(3, 5, 8)
    lin = moe.router_input[0]  # type: ignore[index]
    expected = moe.router(torch.nn.functional.gelu(x @ lin.weight.T + lin.bias)).weights
    torch.testing.assert_close(moe.route(x.reshape(-1, 8)).weights, expected.reshape(15, 4))
    out = moe(x).output
    if router == "topk":  # at most k nonzeros: the sparse path is the dense mixture
        torch.testing.assert_close(out, moe.dense_reference(x), rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    ids = {id(p) for p in moe.router_parameters()}
    assert ids == {id(p) for p in [*moe.router.parameters(), *moe.router_input.parameters()]}  # type: ignore[union-attr]


def test_router_hidden_checks() -> None:
    with pytest.raises(ValueError, match="router_hidden"):
        SparseMoEFeedForward(8, 16, 4, "topk", router_hidden=-1)
    with pytest.raises(ValueError, match="in_features=12"):  # a gate reading the token
        SparseMoEFeedForward(8, 16, 4, make_gate("topk", 4, k=2, in_features=8), router_hidden=12)


# -- the study ----------------------------------------------------------------------------------
def test_defaults_keep_the_records_identity(tmp_path: Path) -> None:
    assert set(TM.DEFAULTS) == _RECORD_KEYS | LATER
    assert TM.DEFAULTS["router_lr_scale"] == 1.0 and TM.DEFAULTS["router_hidden"] == 0
    assert TM.DEFAULTS["capacity_factor"] is None
    assert set(TokenMoEConfig(out=tmp_path).record_hparams()) == _RECORD_KEYS
    cfg = TokenMoEConfig(out=tmp_path, router_lr_scale=0.3, router_hidden=64, capacity_factor=1.25)
    ident = cfg.record_hparams()
    assert ident["router_lr_scale"] == 0.3 and ident["router_hidden"] == 64
    assert ident["capacity_factor"] == 1.25
    assert list(ident) == sorted(ident)


def test_build_model_with_router_hidden_counts_its_parameters() -> None:
    hp = dict(TM.DEFAULTS, **_TINY)
    plain = TM.build_model(TM.ROUTERS["topk"], hp)
    hidden = TM.build_model(TM.ROUTERS["topk"], dict(hp, router_hidden=16))
    extra = sum(p.numel() for p in hidden.parameters()) - sum(p.numel() for p in plain.parameters())
    assert extra == 2 * (16 * 16 + 16)  # one d_model → 16 layer per block
    for m in hidden.moe_layers:
        assert m.router.in_features == 16
        assert sum(p.numel() for p in m.router_parameters()) == 16 * 4 + 4 + 16 * 16 + 16
    logits, _ = hidden(torch.randint(0, 256, (2, 8)))
    assert logits.shape == (2, 8, 256)


@pytest.mark.parametrize("router", ["topk", "dselect_k_distinct", "expert_choice"])
def test_capacity_factor_reaches_every_layer_and_only_when_set(router: str) -> None:
    hp = dict(TM.DEFAULTS, **_TINY)
    torch.manual_seed(0)
    plain = TM.build_model(TM.ROUTERS[router], hp)
    torch.manual_seed(0)
    capped = TM.build_model(TM.ROUTERS[router], dict(hp, capacity_factor=0.5))
    assert all(m.capacity_factor is None for m in plain.moe_layers)
    assert all(m.capacity_factor == 0.5 for m in capped.moe_layers)
    # the same parameters (a capacity adds none): the same initialisation at one seed
    a, b = plain.state_dict(), capped.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(0, 256, (6, 8))
    tokens = x.numel()
    plain_m, capped_m = evaluate(plain, x, x), evaluate(capped, x, x)
    assert "dropped_pairs_per_token" not in plain_m
    for m in capped.moe_layers:
        cap = m.capacity(tokens)
        assert cap is not None and int(m.last_stats["load"].max()) <= cap  # type: ignore[index]
    if router == "expert_choice":  # expert choice has a capacity either way; nothing dropped
        assert "dropped_pairs_per_token" not in capped_m
        assert capped.moe_layers[0].capacity(tokens) == math.ceil(0.5 * tokens * 2 / 4)
        return
    # at c = 0.5 at most half of the k pairs of a token fit: at least k/2 dropped per token
    assert capped_m["dropped_pairs_per_token"] >= 1.0 - 1e-9
    assert plain_m["dispatched_experts_per_token"] == capped_m["dispatched_experts_per_token"]
    assert plain_m["bits_per_byte"] != capped_m["bits_per_byte"]


@pytest.mark.parametrize("router", ["topk", "dselect_k_distinct"])
def test_router_lr_scale_gives_the_routers_their_own_step(router: str) -> None:
    hp = dict(TM.DEFAULTS, **_TINY, router_hidden=16)
    torch.manual_seed(0)
    model = TM.build_model(TM.ROUTERS[router], hp)
    assert make_optimizer_for(model, hp) is None  # scale 1: the training loop's own Adam
    opt = make_optimizer_for(model, dict(hp, router_lr_scale=0.3))
    assert opt is not None and [g["lr"] for g in opt.param_groups] == pytest.approx([2e-3, 6e-4])
    routing = {id(p) for m in model.moe_layers for p in m.router_parameters()}
    assert {id(p) for p in opt.param_groups[1]["params"]} == routing
    n_all = sum(1 for _ in model.parameters())
    assert len(opt.param_groups[0]["params"]) + len(routing) == n_all
    # Adam's first step moves every coordinate with a gradient by its group's lr
    before = {id(p): p.detach().clone() for p in model.parameters()}
    model.loss(torch.randint(0, 256, (4, 8)), torch.randint(0, 256, (4, 8))).backward()
    opt.step()
    for p in model.parameters():
        step = (p.detach() - before[id(p)]).abs().max().item()
        want = 6e-4 if id(p) in routing else 2e-3
        if p.grad is not None and p.grad.abs().max() > 1e-6:
            assert step == pytest.approx(want, rel=1e-3), p.shape


def test_cli_runs_the_options_and_records_them_only_when_set(tmp_path: Path) -> None:
    base = ["reproduce", "token-moe", "--seeds", "1", "--steps", "12", "--batch-size", "4",
            "--d-model", "16", "--d-ff", "16", "--num-experts", "4", "--corpus-bytes", "40000",
            "--seq-len", "16", "--val-windows", "8", "--jobs", "1", "--no-progress",
            "--gates", "topk", "dselect_k_distinct"]  # fmt: skip
    assert main([*base, "--out", str(tmp_path / "d")]) == 0
    assert main([*base, "--out", str(tmp_path / "o"), "--router-lr-scale", "0.5",
                 "--router-hidden", "8", "--capacity-factor", "1.25"]) == 0  # fmt: skip
    for name, keys in (
        ("d", _RECORD_KEYS),
        ("o", _RECORD_KEYS | {"router_lr_scale", "router_hidden", "capacity_factor"}),
    ):
        records = [json.loads(p.read_text()) for p in (tmp_path / name / "runs").glob("*.json")]
        assert len(records) == 2 and all(set(r["config"]["hparams"]) == keys for r in records)
        capped = name == "o"
        assert all(("dropped_pairs_per_token" in r["metrics"]) == capped for r in records)
        report = (tmp_path / name / "report.md").read_text()
        assert ("capacity factor 1.25: each expert" in report) == capped
        assert ("no capacity limit" in report) != capped
    runs = [json.loads(p.read_text()) for p in (tmp_path / "o" / "runs").glob("*.json")]
    (rec,) = [r for r in runs if r["config"]["router"] == "topk"]
    assert rec["config"]["hparams"]["router_hidden"] == 8
    assert rec["config"]["hparams"]["capacity_factor"] == 1.25
    assert rec["metrics"]["router_parameters"] == 2 * (8 * 4 + 4 + 16 * 8 + 8)
    with pytest.raises(SystemExit):  # a capacity factor must be > 0
        main([*base, "--out", str(tmp_path / "z"), "--capacity-factor", "0"])
