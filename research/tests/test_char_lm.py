"""The byte-level MoE transformer (dselectk_research.char_lm): shapes, build order, evaluation."""

from __future__ import annotations

import math

import pytest
import torch

from dselectk.gates import make_gate
from dselectk_research.char_lm import (
    VOCAB,
    CharMoETransformer,
    byte_windows,
    evaluate,
    random_windows,
)


def _model(gate: str = "dselect_k", **kw: int) -> CharMoETransformer:
    return CharMoETransformer(
        lambda: make_gate(gate, 4, k=2, in_features=16), seq_len=8, d_model=16, heads=2, d_ff=16,
        **kw,
    )  # fmt: skip


def test_shapes_aux_and_one_router_per_layer() -> None:
    torch.manual_seed(0)
    model = _model(layers=3)
    logits, aux = model(torch.randint(0, VOCAB, (3, 8)))
    assert logits.shape == (3, 8, VOCAB) and aux.dim() == 0 and float(aux.detach()) > 0
    routers = [m.gate for m in model.moe_layers]
    assert len(routers) == 3 and len({id(r) for r in routers}) == 3
    (logits.square().mean() + aux).backward()
    assert all(p.grad is not None for p in routers[0].parameters())


def test_causal() -> None:
    torch.manual_seed(1)
    model = _model().eval()
    x = torch.randint(0, VOCAB, (2, 8))
    y = x.clone()
    y[:, 5:] = (y[:, 5:] + 1) % VOCAB
    torch.testing.assert_close(model(x)[0][:, :5], model(y)[0][:, :5])


def test_seed_fixes_every_weight() -> None:
    torch.manual_seed(2)
    a = _model().state_dict()
    torch.manual_seed(2)
    b = _model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_arguments() -> None:
    with pytest.raises(ValueError, match="multiple of heads"):
        CharMoETransformer(lambda: make_gate("topk", 4, k=2, in_features=15), seq_len=8,
                           d_model=15, heads=2)  # fmt: skip
    with pytest.raises(ValueError, match="layers"):
        _model(layers=0)


def test_byte_windows_and_evaluate() -> None:
    stream = torch.arange(50) % VOCAB
    x, y = byte_windows(stream, 8)
    assert x.shape == y.shape == (6, 8) and torch.equal(y, x + 1)
    assert byte_windows(stream, 8, limit=2)[0].shape == (2, 8)
    torch.manual_seed(3)
    for gate in ("dselect_k", "topk"):
        m = evaluate(_model(gate), x, y, batch=4)
        assert 0 < m["bits_per_byte"] < 20 and len(m["load"]) == 2
        assert all(math.isclose(sum(f), 1, rel_tol=1e-6) for f in m["load"])
        assert 1 <= m["load_max_over_mean"] <= 4 and 0 < m["experts_per_token"] <= 4
        binary = m["binary_token_fraction"]
        assert (binary is None) == (gate == "topk")
        assert binary is None or 0 <= binary <= 1


def test_random_windows_and_loss() -> None:
    stream = torch.arange(100) % VOCAB
    x, y = random_windows(stream, 8, 5, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (5, 8) and torch.equal(y, x + 1)
    again = random_windows(stream, 8, 5, torch.Generator().manual_seed(0))[0]
    assert torch.equal(x, again) and int(x.max()) <= 99
    torch.manual_seed(4)
    model = _model()
    logits, aux = model(x)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) + aux
    torch.testing.assert_close(model.loss(x, y), expected)


def test_from_settings_is_the_constructor_of_a_settings_mapping() -> None:
    from dselectk_research.char_lm import train_bytes_per_token

    hp = dict(seq_len=8, d_model=16, heads=2, layers=2, d_ff=16, k=2, num_experts=4)
    hp.update(balance_loss_weight=0.01, renormalize=False, lr=0.1)  # lr: not the model's
    torch.manual_seed(3)
    a = CharMoETransformer.from_settings(lambda n, **kw: make_gate("topk", n, **kw), hp)
    torch.manual_seed(3)
    b = _model("topk")
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert [m.routing for m in a.moe_layers] == ["token", "token"]
    c = CharMoETransformer.from_settings(
        lambda n, k, in_features: make_gate("softmax", n, in_features=in_features),
        hp,
        "expert",
    )
    assert [m.routing for m in c.moe_layers] == ["expert", "expert"]
    assert [m.gate.in_features for m in c.moe_layers] == [16, 16]
    routers = [p for m in c.moe_layers for p in m.gate.parameters()]
    assert [id(p) for p in c.router_parameters()] == [id(p) for p in routers]
    # activations per token: 4 bytes × (layers × (16 d + 3 k d_ff + 3 heads L) + 3 × 256)
    assert train_bytes_per_token(hp) == 4.0 * (2 * (16 * 16 + 3 * 2 * 16 + 3 * 2 * 8) + 768)
