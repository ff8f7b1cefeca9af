"""Every registered gate builds on the meta device and becomes a working gate after
``to_empty`` + ``reset_parameters()``, bit for bit the gate the constructor builds on the CPU
with the same seed; and the CPU construction itself is unchanged (digests recorded from the code
before the meta-device work, commit 72f2fab)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dselectk.gates import gate_names
from dselectk.gates.registry import GATES, make_gate

NUM_EXPERTS, IN_FEATURES, BANK = 5, 6, 3


def _configs() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every gate: static and per-example, single and bank, with per-gate hyperparameters."""
    for name in gate_names():
        spec = GATES[name]
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
                if name == "dselect_k":
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
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in sorted(kw.items()))}" for n, kw in CONFIGS]

# sha256 (16 hex digits) of the sorted state_dict and of the eval-mode output (weights, aux
# loss) of each config, built with torch.manual_seed(0) by the code before this change.
_OLD_DIGESTS = """
    7cc64f522405b0e5 30ce231e12ab70df 1afd0f5c99f4cd21 a9ff8f769054d9de 4de01eab44195e74
    8d5a4eb26c278228 b6e8b006b4a36f4c 1c71008d3bbcea5f 7cc64f522405b0e5 30ce231e12ab70df
    c4eba6e990af95ae 1afd0f5c99f4cd21 a9ff8f769054d9de 9601a0a69208af5a 4de01eab44195e74
    8d5a4eb26c278228 d009e65ed8c97abb b6e8b006b4a36f4c 1c71008d3bbcea5f b1ef45a2e02911be
    ba24f6f55fc751db 2db6f009b45e9f90 fcd229e46e49cdab 8715bd6ff50c22b9 9424954fdbae5ed8
    de77cb74402cccdc 724ff6cd17c26b63 f2a52964a239e0da 856be94d39e7df08 0b4c5250cdcd033e
    74b226a938a03ec7 7de34a2a7cb3d3d9 dca205be97ab49d4 b024326d4f1480a0 ff3202616a9e8f45
    9bc67f8f3a9ea692 f51eea5b630482ec a4051a67b147e120 5f61211fc816c52b c92aac21f61d415a
    2ba9ee28441b372a 1c69abb401a4f9d9 391f53a99a36a3bc 122d434602ba974b c54f05e4fff895fb
    a307c686267acf2c c05de873f0a83923 a07e8499954c5a90 22dd937f9549e4f7 3a6a71169cc7e8c4
    7002ea4663db8c01 8f2a37a0ffd53f31 edfcd2d3a5e79054 d8ec3e44da525b21 f240d8d1097e78df
    fd1b838400117bf8 5c7fd915cdc74327 edbff66b80aaa0a8 b255f7355e95c55c cc0d86a73e70b55a
    227614acf196be8f 0c944041f7d77d67 86cd3a3dbda6078e 8e93b78ff5b5959e b9fca18a161be660
    23a6b249430be348 2e10ce78a61a8a5b 6c8e7d120ca45a79 2b7fe8511c2df5a8 dd9d0b613de80238
    83f1b3ad1cc458ac c32b92c1c9824c17 4f792c671ac4e6b8 425ffd6d0511d55c
""".split()


def _x(kw: dict[str, Any]) -> torch.Tensor | None:
    if kw.get("in_features") is None:
        return None
    return torch.randn(4, IN_FEATURES, generator=torch.Generator().manual_seed(1))


def _digest(gate: torch.nn.Module, kw: dict[str, Any]) -> str:
    gate.eval()
    h = hashlib.sha256()
    for key, t in sorted(gate.state_dict().items()):
        h.update(key.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    out = gate(_x(kw))
    h.update(out.weights.detach().numpy().tobytes())
    h.update(out.aux_loss.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def test_configs_cover_every_gate() -> None:
    assert {n for n, _ in CONFIGS} == set(gate_names())
    assert len(CONFIGS) == len(_OLD_DIGESTS)


@pytest.mark.parametrize(("name", "kw"), CONFIGS, ids=IDS)
def test_cpu_construction_unchanged(name: str, kw: dict[str, Any]) -> None:
    torch.manual_seed(0)
    gate = make_gate(name, NUM_EXPERTS, **kw)
    assert _digest(gate, kw) == _OLD_DIGESTS[CONFIGS.index((name, kw))]


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
    assert _digest(gate, kw) == _digest(ref, kw)
    assert _digest(gate, kw) == _OLD_DIGESTS[CONFIGS.index((name, kw))]


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
