"""The TF2-Keras-compatible optimizers of dselectk.optim against the closed form."""

from __future__ import annotations

import math

import pytest
import torch

from dselectk.optim import TF_ADAGRAD_DEFAULTS, make_optimizer

GRADS = [[0.3, -2.0, 1e-3], [-0.1, 0.5, 2e-3], [0.7, 0.0, -1e-3], [0.2, -1.0, 5e-4]]


def _closed_form(lr: float, acc0: float, eps: float) -> list[list[float]]:
    """TF's ApplyAdagradV2: accum += g²; θ -= lr·g / (√accum + ε), from θ = 1."""
    theta, accum, out = [1.0] * 3, [acc0] * 3, []
    for g in GRADS:
        for j in range(3):
            accum[j] += g[j] ** 2
            theta[j] -= lr * g[j] / (math.sqrt(accum[j]) + eps)
        out.append(list(theta))
    return out


def _run(opt_factory) -> list[list[float]]:  # type: ignore[no-untyped-def]
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = opt_factory([p])
    out = []
    for g in GRADS:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        out.append(p.detach().tolist())
    return out


def test_tf_adagrad_matches_tf_closed_form() -> None:
    expected = _closed_form(0.1, 0.1, 1e-7)
    got = _run(lambda ps: make_optimizer("adagrad", ps, lr=0.1, defaults="tf"))
    for e, g in zip(expected, got):
        assert g == pytest.approx(e, rel=1e-12, abs=1e-15)
    got = _run(lambda ps: make_optimizer("adagrad", ps, 0.1, defaults="tf"))
    assert got[-1] == pytest.approx(expected[-1], rel=1e-12)


def test_torch_defaults_are_one_flag_away() -> None:
    expected = _closed_form(0.1, 0.0, 1e-10)
    got = _run(lambda ps: make_optimizer("adagrad", ps, 0.1, defaults="torch"))
    for e, g in zip(expected, got):
        assert g == pytest.approx(e, rel=1e-12, abs=1e-15)
    # the TF accumulator makes the first step of a small gradient far smaller
    tf_first = 1.0 - _closed_form(0.1, 0.1, 1e-7)[0][2]
    torch_first = 1.0 - expected[0][2]
    assert torch_first == pytest.approx(0.1, rel=1e-6) and tf_first < 1e-2 * torch_first


def test_tf_defaults_and_adam() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = make_optimizer("adagrad", [p], 0.05, defaults="tf")
    assert isinstance(opt, torch.optim.Adagrad)
    g = opt.param_groups[0]
    assert g["eps"] == TF_ADAGRAD_DEFAULTS["eps"] == 1e-7 and g["lr_decay"] == 0
    assert g["initial_accumulator_value"] == 0.1
    assert torch.equal(opt.state[p]["sum"], torch.full((2,), 0.1))
    adam = make_optimizer("adam", [p], 1e-3, defaults="tf")
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["eps"] == 1e-7
    assert make_optimizer("adam", [p], 1e-3, defaults="torch").param_groups[0]["eps"] == 1e-8
    with pytest.raises(ValueError, match="defaults"):
        make_optimizer("adam", [p], 1e-3, defaults="keras")
    with pytest.raises(ValueError, match="adagrad or adam"):
        make_optimizer("sgd", [p], 1e-3, defaults="tf")


@pytest.mark.parametrize("name", ["adam", "adagrad", "sgd"])
def test_one_factory_builds_torch_optimizers_with_their_keywords(name: str) -> None:
    """make_optimizer is the torch optimizer with lr, weight_decay and foreach=True, nothing
    else (torch's constants), or with TF2 Keras' on top ("tf"): the same class and groups."""
    cls = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[name]
    p = torch.nn.Parameter(torch.zeros(2))
    got = make_optimizer(name, [p], 0.01, 1e-3)
    want = cls([p], lr=0.01, weight_decay=1e-3, foreach=True)
    assert type(got) is cls and got.param_groups[0] == want.param_groups[0]
    if name != "sgd":
        tf = make_optimizer(name, [p], 0.01, defaults="tf")
        extra = TF_ADAGRAD_DEFAULTS if name == "adagrad" else {"betas": (0.9, 0.999), "eps": 1e-7}
        want = cls([p], lr=0.01, foreach=True, **extra)
        assert tf.param_groups[0] == want.param_groups[0]


def test_make_optimizer_names_the_bad_argument() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    for bad, match in [
        (dict(name="rmsprop"), "name must be one of"),
        (dict(lr=0.0), "lr must be a finite number > 0"),
        (dict(lr=-1e-3), "lr must be"),
        (dict(lr=math.nan), "lr must be"),
        (dict(lr=math.inf), "lr must be"),
        (dict(lr=True), "lr must be"),
        (dict(lr="0.1"), "lr must be"),
        (dict(weight_decay=-1.0), "weight_decay must be a finite number >= 0"),
        (dict(weight_decay=math.nan), "weight_decay must be"),
        (dict(defaults=None), "defaults must be one of"),
        (dict(weight_decay=0.1, defaults="tf"), "weight_decay must be 0 with defaults='tf'"),
    ]:
        kw = {"name": "adam", "lr": 1e-3, **bad}
        name, lr = kw.pop("name"), kw.pop("lr")
        with pytest.raises(ValueError, match=match):
            make_optimizer(name, [p], lr, **kw)  # type: ignore[arg-type]
