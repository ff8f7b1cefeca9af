"""DSelect-k transformers models loaded by name, the transformers way: ``from_config`` and
``AutoModelForCausalLM.from_pretrained`` build this package's routers once
``dselectk.integrations.hf`` is imported; plain transformers refuses the folder (an error naming
dselectk) instead of building fresh Top-k routers; seeded initialisation is the same eager and on
the meta device; every weight conversion of the family still finds its weights; the routers
compile to one graph. Tiny random models of every supported family; nothing is downloaded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dselectk.gates import DSelectK  # noqa: E402
from dselectk.integrations import hf  # noqa: E402
from test_hf_persistence import FAMILIES, _config, _ids, _model_cls, _routers, _train  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_from_config_and_auto_from_pretrained_by_name(family: str, tmp_path: Path) -> None:
    cfg = hf.with_routers(_config(family), "dselect_k", gamma=0.5, entropy_reg=0.01)
    assert cfg.model_type == "dselectk_" + _config(family).model_type
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert isinstance(model, _model_cls(family)) and type(model).__name__.startswith("DSelectK")
    routers = _routers(model)
    assert len(routers) == 2 and all(isinstance(r.gate_module, DSelectK) for r in routers)
    assert all(r.gate_module.gamma == 0.5 for r in routers)
    # initialised by the gate (DSelect-k's U(±γ/100)), not transformers' N(0, 0.02)
    assert all(float(r.gate_module.proj.weight.detach().abs().max()) <= 0.5 / 100 for r in routers)
    _train(model, steps=2)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == cfg.model_type
    assert saved["auto_map"]["AutoModelForCausalLM"].endswith(
        f"DSelectK{_model_cls(family).__name__}"
    )
    assert (tmp_path / hf.AUTO_FILE).is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(model) and len(_routers(loaded)) == 2
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    for p in loaded.parameters():  # out of the checkpoint's memory map (see test_life_cycle)
        p.data = p.data.clone()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=_ids()).logits, model(input_ids=_ids()).logits)
    # the documented helper gives the same model
    again = hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    assert type(again) is type(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_by_name_class_picks_the_family_implementations(family: str) -> None:
    """transformers picks the experts and attention implementations from the source of the
    model class' module; the DSelectK<Model> class (defined in dselectk) gets the family's own
    (``grouped_mm`` experts, not the ``eager`` loop fullgraph compile cannot trace), in either
    order of first construction."""
    ours = transformers.AutoModelForCausalLM.from_config(hf.with_routers(_config(family)))
    plain = _model_cls(family)(_config(family))
    for attr in ("_experts_implementation", "_attn_implementation"):
        assert getattr(ours.config, attr) == getattr(plain.config, attr), attr
    assert ours.config._experts_implementation == "grouped_mm"


def test_replace_routers_then_save_loads_by_name(tmp_path: Path) -> None:
    """A model built plain and swapped afterwards (replace_routers) saves the same way."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    hf.replace_routers(model, "topk")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert [type(r.gate_module).__name__ for r in _routers(loaded)] == ["TopKGate"] * 2
    with torch.no_grad():
        want = model.eval()(input_ids=_ids()).logits
        torch.testing.assert_close(loaded(input_ids=_ids()).logits, want, rtol=0, atol=1e-6)
    # a callable router is not recorded: the config is plain again
    hf.replace_routers(model, lambda n, d, k: DSelectK(n, k, in_features=d))
    assert type(model.config) is transformers.MixtralConfig
    assert model.config.model_type == "mixtral" and not hasattr(model.config, "auto_map")


_BLOCK_DSELECTK = """
import sys
class _NoDSelectK:
    def find_spec(self, name, path=None, target=None):
        if name == "dselectk" or name.startswith("dselectk."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoDSelectK())
"""


def _run(code: str, env_src: bool) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC if env_src else ""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )


def test_plain_transformers_refuses_the_folder(tmp_path: Path) -> None:
    """Without dselectk, loading the folder raises (transformers asks for the custom code; with
    trust_remote_code it names dselectk and how to install it) and never builds fresh routers.
    With dselectk installed but not imported, trust_remote_code=True loads the model."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    hf.replace_routers(model, "dselect_k")
    model.eval().save_pretrained(tmp_path)
    with torch.no_grad():
        torch.save(model(input_ids=_ids()).logits, tmp_path / "want.pt")
    code = _BLOCK_DSELECTK + (
        "import transformers\n"
        "for trust in (None, True):\n"
        "    try:\n"
        f"        transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, "
        "trust_remote_code=trust)\n"
        "        print('LOADED')\n"
        "    except (ValueError, ImportError) as e:\n"
        "        print(type(e).__name__, '|', str(e).replace(chr(10), ' '))\n"
    )
    out = _run(code, env_src=False)
    lines = [line for line in out.stdout.splitlines() if "|" in line or line == "LOADED"]
    assert "LOADED" not in lines, out.stdout + out.stderr
    assert len(lines) == 2, out.stdout + out.stderr
    # step 1 (no flag): transformers asks for trust_remote_code and names the folder, whose
    # auto_map file says what it needs; step 2 (the flag): the missing package by name
    assert "ValueError |" in lines[0] and "trust_remote_code=True" in lines[0]
    assert str(tmp_path) in lines[0]
    auto_file = (tmp_path / hf.AUTO_FILE).read_text()
    assert "import dselectk" in auto_file and 'pip install -e ".[transformers]"' in auto_file
    assert "ImportError |" in lines[1] and "not found in your environment: dselectk" in lines[1]
    assert "pip install dselectk" in lines[1]
    code = (
        "import torch, transformers\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, "
        "trust_remote_code=True).eval()\n"
        f"want = torch.load({str(tmp_path / 'want.pt')!r})\n"
        "ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))\n"
        "with torch.no_grad(): got = m(input_ids=ids).logits\n"
        "print(type(m).__name__, type(m.model.layers[0].mlp.gate).__name__, "
        "float((got - want).abs().max()))\n"
    )
    out = _run(code, env_src=True)
    assert out.returncode == 0, out.stderr
    name, router, diff = out.stdout.split()[-3:]
    assert (name, router) == ("DSelectKMixtralForCausalLM", "GateMixtralTopKRouter")
    assert float(diff) <= 1e-6


@contextmanager
def _seeded_init() -> Any:
    """A seed before each module's initialisation (transformers' own tests do the same to
    compare eager construction with meta-device construction and init)."""
    base = transformers.PreTrainedModel._initialize_weights

    def seeded(self: Any, module: Any, is_custom_code: bool = False) -> None:
        torch.manual_seed(0)
        base(self, module, is_custom_code)

    transformers.PreTrainedModel._initialize_weights = seeded
    try:
        yield
    finally:
        transformers.PreTrainedModel._initialize_weights = base


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("gate", ["dselect_k", "topk"])
def test_seeded_init_eager_equals_meta_and_init(family: str, gate: str) -> None:
    cfg = hf.with_routers(_config(family), gate)
    cls = hf._hooked_class(_model_cls(family))
    with _seeded_init():
        eager = cls(cfg)
        with torch.device("meta"):
            meta = cls(cfg)
        meta.to_empty(device="cpu")
        meta.init_weights()
        loaded = cls.from_pretrained(None, config=cfg, state_dict={})
    assert len(_routers(eager)) == 2
    want = eager.state_dict()
    for other in (meta, loaded):
        got = other.state_dict()
        assert got.keys() == want.keys()
        router_keys = [k for k in want if "gate_module" in k]
        assert router_keys
        for key in router_keys:
            assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_weight_conversions_find_their_weights(family: str) -> None:
    """Every rename or merge transformers applies when loading (and reverses when saving) the
    family's checkpoints names weights the swapped model has (Granite-MoE renames its router's
    ``router.layer.weight``: the gate replaces that weight, so that renaming is dropped)."""
    conversion = pytest.importorskip("transformers.conversion_mapping")
    cfg = hf.with_routers(_config(family), "dselect_k")
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    keys = list(model.state_dict())
    for transform in conversion.get_model_conversion_mapping(model, add_legacy=False):
        targets = transform.target_patterns
        for pattern in [targets] if isinstance(targets, str) else targets:
            assert any(re.search(pattern, k) for k in keys), (family, pattern)


def test_gate_compiles_to_one_graph_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """fullgraph=True: the small CPU kernel is one operator of the graph, running the eager
    kernel; values and gradients match the eager gate to float rounding (eager, the gate also
    fuses its linear layer into the host node)."""
    monkeypatch.setenv("DSELECTK_KERNEL", "numpy")
    torch._dynamo.reset()
    torch.manual_seed(0)
    gate = DSelectK(16, 4, in_features=8, entropy_reg=0.1)
    x = torch.randn(6, 8)
    compiled = torch.compile(gate, fullgraph=True, backend="aot_eager")
    got, want = compiled(x), gate(x)
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=1e-7)
    grads = []
    for out in (got, want):
        gate.zero_grad()
        (out.weights.square().sum() + out.aux_loss).backward()
        grads.append([p.grad.clone() for p in gate.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# Mixtral through aot_eager runs with the default tests (15-25 s on a busy 2-core machine); every
# other family and backend with -m slow (aot_eager: 10-45 s a family; inductor, which compiles
# C++: 40-190 s a family there).
_COMPILE_CASES = [
    pytest.param(
        family,
        backend,
        marks=() if (family, backend) == ("mixtral", "aot_eager") else pytest.mark.slow,
        id=f"{family}-{backend}",
    )
    for backend in ("aot_eager", "inductor")
    for family in sorted(FAMILIES)
]


@pytest.mark.parametrize(("family", "backend"), _COMPILE_CASES)
def test_model_compiles_to_one_graph(family: str, backend: str) -> None:
    """torch.compile(fullgraph=True) of the whole model built by name (DSelect-k routers, the
    family's default grouped_mm experts): one graph, the eager logits. Not bit for bit: the
    compiled graph computes the same operations in another order (aot_eager's decompositions;
    inductor's fused C++ loops), a few float32 ulps of logits of size ~0.4 (measured up to
    1.2e-7); the tolerance is 1e-5 relative plus 1e-6 absolute."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf.with_routers(_config(family))).eval()
    assert model.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        want = model(input_ids=_ids(), use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        got = compiled(input_ids=_ids(), use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_with_routers_refuses_configs_it_cannot_apply_to() -> None:
    """A config of a model without MoE blocks (Llama) or no config at all is refused up front,
    never returned as a DSelect-k config whose routers no model would get."""
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="LlamaConfig is not a supported MoE family"):
        hf.with_routers(
            LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2), "dselect_k"
        )
    with pytest.raises(TypeError, match="config: expected a transformers PretrainedConfig"):
        hf.with_routers({"a": 1}, "dselect_k")
