"""Every registered gate builds on the meta device and becomes a working gate after
``to_empty`` + ``reset_parameters()``, bit for bit the gate the constructor builds on the CPU
with the same seed (tensors and outputs); and the CPU construction itself is unchanged (digests
recorded from the code before the meta-device work, commit 72f2fab)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dselectk.gates import DSelectK, gate_names
from dselectk.gates.registry import GATES, make_gate

NUM_EXPERTS, IN_FEATURES, BANK = 5, 6, 3


def _configs(before: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every gate: static and per-example, single and bank, with per-gate hyperparameters.
    ``before``: the configs of the digests below, when "dselect_k" still took ``init`` and
    ``diversity`` (now options of "dselect_k_extended")."""
    names = sorted((set(gate_names()) - {"dselect_k_extended"}) if before else gate_names())
    for name in names:
        spec = GATES["dselect_k_extended" if before and name == "dselect_k" else name]
        for per_example in (False, True):
            for bank in (None, BANK):
                per_gate = [0.5, 1.0, 2.0] if bank else None
                variants: list[dict[str, Any]] = [{}]
                if "gamma" in spec.hparams:
                    variants.append({"gamma": per_gate or 0.3})
                if "temperature" in spec.hparams:
                    variants.append({"temperature": per_gate or 0.7})
                if "entropy_reg" in spec.hparams and name != "ablation_annealing":
                    variants.append({"entropy_reg": [0.0, 0.1, 0.2] if bank else 0.1})
                if name == ("dselect_k" if before else "dselect_k_extended"):
                    variants.append({"init": "spread", "gamma": per_gate or 0.3})
                    variants.append({"diversity": [0.0, 0.1, 0.2] if bank else 0.1})
                if name == "topk" and per_example:
                    variants.append({"noisy": True})
                if name == "gumbel_softmax":
                    variants.append({"init_keep_logit": 1.5})
                for hp in variants:
                    kw = dict(hp)
                    if per_example:
                        kw["in_features"] = IN_FEATURES
                    if bank:
                        kw["num_gates"] = bank
                    if spec.takes_k:
                        kw["k"] = 2
                    yield name, kw


CONFIGS = list(_configs())
_BEFORE = list(_configs(before=True))
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in sorted(kw.items()))}" for n, kw in CONFIGS]

# sha256 (16 hex digits) of the sorted state_dict of each config, built with
# torch.manual_seed(0) by the code before this change (72f2fab): the initialisation is unchanged.
# (The outputs are compared between the two builds below, not against stored values, so that a
# change of the gates' math is not mistaken for one of their initialisation.)
_OLD_DIGESTS = """
    9fa74d9024b50126 541b6035a93fe7ef 6f2683c7eb2496da 3ede06f169d1ad10 55c36dde17c0d787
    53764155c2f886cf 6e6739523427c98b 5469d6c96e67b91f 9fa74d9024b50126 541b6035a93fe7ef
    d942cc62f5bb5baf 6f2683c7eb2496da 3ede06f169d1ad10 e3074cdc3c910cdc 55c36dde17c0d787
    53764155c2f886cf e67835dbca1527a6 6e6739523427c98b 5469d6c96e67b91f fed219f000bf8d36
    877e2d799540559b 67b4111452afe324 079f83e837ef0681 b14fb958db3a68ae f2ebc1448de2458b
    6ef48850e961a852 a4587f0aed6068c9 41c8a2b5fcdc9f97 0ac8190778aa5c17 8f83a33b0f7bd247
    4403a137b6acf99e db00b42f6f5efce6 8ccf8158c65b9cf8 54f33e3cb34ff868 cd35308661972d89
    fa066ff89f1660c9 f803b6b68a5a2de3 0aaa1695a860c65d d2cb8455b7c6b8c7 966c8c65bcabc5f6
    98538ed2ce4cccf2 45ea228f050f80ec a840e31d9d8024af cac986dfbad310c0 e779946585d4fa71
    61df980fa149271f bec97e10025d0aac e7f55a6604f1db7c b9469476ef2b05f8 c91a9807ae57c3fc
    31cf0f97be1a2dff ee6913f06757b8cd dc7add3e8d1014a3 e519ad4dc3ed10f5 6a65ad4b03654fbd
    8121252b21d43462 de97287f62b92e28 b84b45c322be4e6d a66164f88c93a48d 8cfd3b95743cf17a
    a7ad4bbd9f8b5d81 9c9d09d5f6280328 c1de68e5c23cc088 f4fe06f6f5440b77 be522f3fa7509e1f
    1f3d9219792f70dd a60134e83f47caea 3b40dbebaeb66302 2cd0cccb9aef91bc 90be6f5c5003f650
    a60134e83f47caea 68e199124c67442f 3b40dbebaeb66302 710fb75f49d7a286
""".split()


def _x(kw: dict[str, Any]) -> torch.Tensor | None:
    if kw.get("in_features") is None:
        return None
    return torch.randn(4, IN_FEATURES, generator=torch.Generator().manual_seed(1))


def _digest(gate: torch.nn.Module) -> str:
    h = hashlib.sha256()
    state = gate.state_dict()
    if type(gate) is DSelectK:  # the buffer of its former diversity option, then always 0 here
        state["_diversity"] = torch.tensor(0.0)
    for key, t in sorted(state.items()):
        if key.endswith("_extra_state"):  # the gate's meaning [n, k], not a constructed value
            continue
        h.update(key.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _old_digest(name: str, kw: dict[str, Any]) -> str:
    """The digest of the same gate built by the code of 72f2fab (the DSelect-k research options
    were then "dselect_k"'s)."""
    return _OLD_DIGESTS[_BEFORE.index(("dselect_k" if name == "dselect_k_extended" else name, kw))]


def test_configs_cover_every_gate() -> None:
    assert {n for n, _ in CONFIGS} == set(gate_names())
    assert len(_BEFORE) == len(_OLD_DIGESTS)
    for name, kw in CONFIGS:
        _old_digest(name, kw)  # each has its digest


@pytest.mark.parametrize(("name", "kw"), CONFIGS, ids=IDS)
def test_cpu_construction_unchanged(name: str, kw: dict[str, Any]) -> None:
    torch.manual_seed(0)
    gate = make_gate(name, NUM_EXPERTS, **kw)
    assert _digest(gate) == _old_digest(name, kw)


@pytest.mark.parametrize(("name", "kw"), CONFIGS, ids=IDS)
def test_meta_build_then_materialise(name: str, kw: dict[str, Any]) -> None:
    with torch.device("meta"):
        gate = make_gate(name, NUM_EXPERTS, **kw)
    assert all(t.is_meta for t in (*gate.parameters(), *gate.buffers()))
    repr(gate)  # hyperparameters read on the meta device: the values assigned
    for hp in ("gamma", "temperature", "entropy_reg", "diversity"):
        if hp in kw:
            got = getattr(gate, hp)
            want = kw[hp]
            if isinstance(got, torch.Tensor):
                torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype))
            else:
                assert got == pytest.approx(want)
    gate.to_empty(device="cpu")
    torch.manual_seed(0)
    gate.reset_parameters()
    torch.manual_seed(0)
    ref = make_gate(name, NUM_EXPERTS, **kw)
    got, want = gate.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert _digest(gate) == _old_digest(name, kw)
    gate.eval()
    ref.eval()
    got_out, want_out = gate(_x(kw)), ref(_x(kw))
    assert torch.equal(got_out.weights, want_out.weights)
    assert torch.equal(got_out.aux_loss, want_out.aux_loss)


@pytest.mark.parametrize("name", gate_names())
def test_meta_build_by_device_argument(name: str) -> None:
    """``meta`` as the default device (what transformers does), then a plain ``to_empty``."""
    kw: dict[str, Any] = {"in_features": IN_FEATURES}
    if GATES[name].takes_k:
        kw["k"] = 2
    torch.set_default_device("meta")
    try:
        gate = make_gate(name, NUM_EXPERTS, **kw)
    finally:
        torch.set_default_device(None)
    gate.to_empty(device="cpu")
    gate.reset_parameters()
    out = gate(torch.randn(3, 2, IN_FEATURES))
    assert out.weights.shape == (3, 2, NUM_EXPERTS)
    assert torch.isfinite(out.weights).all()


def test_reset_restores_assigned_hyperparameters() -> None:
    """After ``to_empty`` the buffers hold garbage; reset_parameters writes the values back,
    including values assigned (a schedule) after construction."""
    with torch.device("meta"):
        gate = make_gate("dselect_k", 8, k=2, in_features=4, num_gates=2, gamma=[0.5, 2.0])
    gate.entropy_reg = 0.25
    gate.to_empty(device="cpu")
    gate.reset_parameters()
    torch.testing.assert_close(gate.gamma, torch.tensor([0.5, 2.0]))
    assert gate.entropy_reg == 0.25
    assert type(gate).entropy_reg.is_nonzero(gate)


def test_loaded_values_are_the_record() -> None:
    """A loaded state dict's hyperparameters are what reset_parameters restores afterwards."""
    src = make_gate("dselect_k", 8, k=2, in_features=4, gamma=0.5)
    dst = make_gate("dselect_k", 8, k=2, in_features=4, gamma=1.0)
    dst.load_state_dict(src.state_dict())
    dst.reset_parameters()
    assert dst.gamma == 0.5
