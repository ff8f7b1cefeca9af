"""DSelect-k routers in transformers MoE models, the whole life cycle, per supported family:
built on the meta device, ``init_weights()``, a few training steps, ``save_pretrained``, back
through :func:`dselectk.integrations.hf.from_pretrained` with the same logits, greedy ``generate``
with and without the KV cache. Tiny random models from a config; nothing is downloaded."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dselectk.gates import DSelectK  # noqa: E402
from dselectk.integrations import hf  # noqa: E402

VOCAB, HIDDEN, N_EXPERTS, TOP_K = 64, 32, 4, 2
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts_per_tok=TOP_K,
    max_position_embeddings=64,
)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": N_EXPERTS}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": N_EXPERTS,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": N_EXPERTS, "moe_intermediate_size": 16, "head_dim": 16},
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": N_EXPERTS}),
    "flex_olmo": (
        "FlexOlmoConfig",
        "FlexOlmoForCausalLM",
        {"num_experts": N_EXPERTS, "pad_token_id": 0},
    ),
    "minimax": (
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        {"num_local_experts": N_EXPERTS, "head_dim": 16, "layer_types": ["full_attention"] * 2},
    ),
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        {
            "num_experts": N_EXPERTS,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 1,
            "expert_layer_offset": 0,
            "use_mamba_kernels": False,
        },
    ),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {"num_local_experts": N_EXPERTS}),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"num_local_experts": N_EXPERTS, "head_dim": 16, "layer_types": ["full_attention"] * 2},
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            "num_experts": N_EXPERTS,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "head_dim": 16,
            "layer_types": ["full_attention", "linear_attention"],
        },
    ),
}


def _config(family: str, **kw: Any) -> Any:
    config_cls, _, extra = FAMILIES[family]
    return getattr(transformers, config_cls)(**_COMMON, **extra, **kw)


def _model_cls(family: str) -> Any:
    return getattr(transformers, FAMILIES[family][1])


def _ids(seed: int = 1, shape: tuple[int, int] = (2, 6)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _routers(model: torch.nn.Module) -> list[hf.GateRouter]:
    return [m for m in model.modules() if isinstance(m, hf.GateRouter)]


def _dselect_k_init_ok(router: hf.GateRouter, gamma: float) -> bool:
    """The router holds DSelect-k's initialisation (U(±γ/100)), not transformers' N(0, 0.02)."""
    gate = router.gate_module
    assert isinstance(gate, DSelectK) and gate.proj is not None
    return bool(gate.proj.weight.abs().max() <= gamma / 100)


def _train(model: torch.nn.Module, steps: int = 3) -> list[float]:
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = _ids(2, (4, 8))
    losses = []
    for _ in range(steps):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    model.eval()
    return losses


def _greedy(model: Any, use_cache: bool) -> torch.Tensor:
    # output_router_logits=False: transformers 5.24's own load-balancing loss fails inside a
    # cached generate of these families (the attention mask covers the whole sequence, the
    # router logits the new token only), with transformers' routers as with ours.
    with torch.no_grad():
        return model.generate(
            _ids(3, (2, 4)),
            max_new_tokens=6,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=0,
            output_router_logits=False,
        )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_life_cycle(family: str, tmp_path: Path) -> None:
    gamma = 0.5
    cfg = _config(family, output_router_logits=True, router_aux_loss_coef=0.01)
    # 1. built on the meta device, routers swapped there
    with torch.device("meta"):
        model = _model_cls(family)(cfg)
        routers = hf.replace_routers(
            model, "dselect_k", selectors=None, renormalize=False, gamma=gamma, entropy_reg=0.01
        )
    assert len(routers) == 2
    assert all(p.is_meta for p in model.parameters())
    # 2. materialised and initialised by transformers: the routers end with DSelect-k's init
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert all(_dselect_k_init_ok(r, gamma) for r in _routers(model))
    assert all(r.gate_module.gamma == gamma for r in _routers(model))
    # 3. trains (router logits recorded, balancing loss and the gates' entropy in the loss)
    losses = _train(model)
    assert all(torch.isfinite(torch.tensor(losses)))
    with torch.no_grad():
        out = model(input_ids=_ids())
    assert len(out.router_logits) == 2
    # a schedule moved a hyperparameter: the saved and loaded value is the moved one
    for r in _routers(model):
        r.gate_module.gamma = 0.25
    # 4. saved, loaded through the documented path: same class of routers, same logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved[hf.CONFIG_KEY]["gate"] == "dselect_k"
    assert saved[hf.CONFIG_KEY]["gate_kwargs"] == {"entropy_reg": 0.01, "gamma": gamma, "k": TOP_K}
    loaded = hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    assert isinstance(loaded, _model_cls(family))
    assert len(_routers(loaded)) == 2
    assert all(r.gate_module.gamma == 0.25 for r in _routers(loaded))
    with torch.no_grad():
        want = model(input_ids=_ids()).logits
        got = loaded(input_ids=_ids()).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    # bit for bit once the loaded tensors are out of the checkpoint's memory map (its alignment
    # changes the CPU kernels' summation order by a few ulps, as for any transformers model)
    for p in loaded.parameters():
        p.data = p.data.clone()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=_ids()).logits, want)
    # 5. greedy generation: the same tokens with and without the cache, before and after loading
    with_cache = _greedy(model, use_cache=True)
    assert with_cache.shape == (2, 10)
    assert torch.equal(_greedy(model, use_cache=False), with_cache)
    assert torch.equal(_greedy(loaded, use_cache=True), with_cache)
    assert torch.equal(_greedy(loaded, use_cache=False), with_cache)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("gate", ["dselect_k", "topk", "softmax"])
def test_init_weights_is_the_gates_own(family: str, gate: str) -> None:
    """Whatever transformers calls (init_weights, _init_weights on a router), the router ends
    with its gate's initialisation: the same tensors as gate.reset_parameters() draws."""
    torch.manual_seed(0)
    model = _model_cls(family)(_config(family))
    router = hf.replace_routers(model, gate)[0]
    model.init_weights()
    ref = copy.deepcopy(router.gate_module)
    torch.manual_seed(5)
    model._init_weights(router)
    torch.manual_seed(5)
    ref.reset_parameters()
    for key, value in ref.state_dict().items():
        assert torch.equal(router.gate_module.state_dict()[key], value), key
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=_ids()).logits).all()


def test_loading_keeps_loaded_tensors_and_from_pretrained_options(tmp_path: Path) -> None:
    """transformers' loader marks loaded tensors; the routers' init keeps them. dtype and
    device_map go through transformers' from_pretrained."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    hf.replace_routers(model, "dselect_k", gamma=2.0)
    _train(model, steps=1)
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(transformers.MixtralForCausalLM, str(tmp_path), dtype=torch.float64)
    assert type(loaded).__name__ == "DSelectKMixtralForCausalLM"
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value.double(), rtol=0, atol=0)
    assert all(r.gate_module.proj.weight.dtype == torch.float64 for r in _routers(loaded))


@pytest.mark.parametrize("where", ["cpu", "auto", "disk-offload"])
def test_device_map_loads_the_same_model(where: str, tmp_path: Path) -> None:
    """``device_map`` (accelerate) builds the model on the meta device and places or offloads
    its modules; a DSelect-k model comes back with the same logits, also with a layer on disk."""
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    hf.replace_routers(model, "dselect_k", gamma=2.0)
    _train(model, steps=1)
    model.save_pretrained(tmp_path / "m")
    kwargs: dict[str, Any] = {"device_map": where}
    if where == "disk-offload":
        layers = model.config.num_hidden_layers
        dm = {name: "cpu" for name in ("model.embed_tokens", "model.norm", "model.rotary_emb")}
        dm.update({"lm_head": "cpu", **{f"model.layers.{i}": "cpu" for i in range(layers - 1)}})
        dm[f"model.layers.{layers - 1}"] = "disk"
        kwargs = {"device_map": dm, "offload_folder": str(tmp_path / "offload")}
    loaded = hf.from_pretrained(transformers.MixtralForCausalLM, tmp_path / "m", **kwargs)
    assert type(loaded).__name__ == "DSelectKMixtralForCausalLM"
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=_ids()).logits, model(input_ids=_ids()).logits, rtol=0, atol=0
        )
    if where == "disk-offload":
        assert "disk" in loaded.hf_device_map.values()


def _as_first_format(folder: Path) -> None:
    """The folder as the first release of the adapter saved it: the family's own model type,
    no ``auto_map``, no :data:`hf.AUTO_FILE` (plain transformers loads such a folder)."""
    saved = json.loads((folder / "config.json").read_text())
    saved["model_type"] = saved["model_type"].removeprefix(hf.MODEL_TYPE_PREFIX)
    saved.pop("auto_map")
    (folder / "config.json").write_text(json.dumps(saved))
    (folder / hf.AUTO_FILE).unlink()


def test_plain_transformers_load(tmp_path: Path) -> None:
    """A folder saved in the first format (the family's own model type) loads in plain
    transformers with its own routers, freshly initialised (a load report lists them as MISSING
    and the gates as UNEXPECTED); the config keeps the field, check_loaded says what happened,
    and hf.from_pretrained loads it with its routers. (Folders saved now are refused by plain
    transformers: tests/test_hf_by_name.py.)"""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    hf.replace_routers(model, "dselect_k")
    model.eval().save_pretrained(tmp_path)
    _as_first_format(tmp_path)
    back = hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    assert len(_routers(back)) == 2
    with torch.no_grad():
        want, got = model(input_ids=_ids()).logits, back(input_ids=_ids()).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    plain, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert not _routers(plain)
    assert getattr(plain.config, hf.CONFIG_KEY)["gate"] == "dselect_k"
    assert "model.layers.0.mlp.gate.weight" in info["missing_keys"]
    assert "model.layers.0.mlp.gate.gate_module.proj.weight" in info["unexpected_keys"]
    with pytest.raises(ValueError, match=r"saved with 'dselect_k' routers.*from_pretrained"):
        hf.check_loaded(plain)
    hf.check_loaded(model)  # the real thing passes


def test_folder_without_routers_loads_plain(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    assert type(loaded) is transformers.MixtralForCausalLM and not _routers(loaded)
    hf.check_loaded(loaded)


def test_config_records_choice_and_callable_is_not_recorded() -> None:
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    hf.replace_routers(
        model, "comet", selectors=None, gamma=0.5, aux_loss_weight=0.5, renormalize=True
    )
    entry = getattr(model.config, hf.CONFIG_KEY)
    assert entry == hf.router_config(
        "comet", gamma=0.5, selectors=TOP_K, aux_loss_weight=0.5, renormalize=True
    )
    hf.replace_routers(model, lambda n, d, k: DSelectK(n, k, in_features=d))
    assert not hasattr(model.config, hf.CONFIG_KEY)
    with pytest.raises(TypeError, match="cannot be saved"):
        hf.replace_routers(model, "dselect_k", gamma=torch.tensor(0.5))
    with pytest.raises(ValueError, match="unknown gate"):
        hf.router_config("nope")


def test_newer_format_refused(tmp_path: Path) -> None:
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    hf.replace_routers(model, "dselect_k")
    getattr(model.config, hf.CONFIG_KEY)["format"] = 99
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="newer"):
        hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)


def test_gradient_checkpointing_same_gradients() -> None:
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(_config("mixtral", output_router_logits=True))
    hf.replace_routers(model, "dselect_k", entropy_reg=0.1)
    model.train()
    ids = _ids(4, (2, 8))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.activation_checkpointing_enable({"use_reentrant": False})
    ckpt = grads()
    assert plain.keys() == ckpt.keys()
    assert any("gate_module" in n for n in plain)
    for name, g in plain.items():
        torch.testing.assert_close(ckpt[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_torch_compile_forward() -> None:
    """One graph (fullgraph=True, inductor), the logits of the eager model."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    hf.replace_routers(model, "dselect_k")
    model.eval()
    ids = _ids()
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True)
        got = compiled(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_whole_model_pickles(tmp_path: Path) -> None:
    """The DSelectK<Name> classes are globals of dselectk.integrations.hf: torch.save of the
    whole model (not only its state dict) loads back."""
    torch.manual_seed(0)
    model = transformers.OlmoeForCausalLM(_config("olmoe"))
    hf.replace_routers(model, "dselect_k")
    model.eval()
    torch.save(model, tmp_path / "model.pt")
    back = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(back) is type(model) and len(_routers(back)) == 2
    with torch.no_grad():
        assert torch.equal(back(input_ids=_ids()).logits, model(input_ids=_ids()).logits)


def test_whole_model_unpickles_in_a_fresh_process(tmp_path: Path) -> None:
    import subprocess
    import sys

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    hf.replace_routers(model, "dselect_k")
    torch.save(model, tmp_path / "model.pt")
    code = (
        "import torch; m = torch.load({!r}, weights_only=False); "
        "print(type(m).__name__, type(m.model.layers[0].mlp.gate).__name__)"
    ).format(str(tmp_path / "model.pt"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["DSelectKMixtralForCausalLM", "GateMixtralTopKRouter"]


def test_other_router_contracts_refused() -> None:
    class Router(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.top_k, self.num_experts, self.hidden_dim = 2, 4, 8
            self.weight = torch.nn.Parameter(torch.zeros(4, 8))
            self.e_score_correction_bias = torch.nn.Buffer(torch.zeros(4))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.experts = Router(), torch.nn.Linear(8, 8)

    with pytest.raises(ValueError, match="DeepSeek-V3 style"):
        hf.replace_routers(Block())


def test_three_selector_router_dispatches_top_k_and_round_trips(tmp_path: Path) -> None:
    """The per-token recipe of research/notes/per_token.md §4q in a transformers model: a DSelect-k
    router with one selector more than the model's top_k (selectors=3, λ = 0, renormalised). Every
    token still reaches top_k = 2 experts, and the choice is saved and loaded back."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    routers = hf.replace_routers(model, "dselect_k", selectors=3, entropy_reg=0.0, renormalize=True)
    assert all(r.gate_module.k == 3 for r in routers)
    seen: list[torch.Tensor] = []
    block = next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))
    handle = block.gate.register_forward_hook(lambda mod, args, out: seen.append(out))
    with torch.no_grad():
        model(input_ids=_ids())
    handle.remove()
    _, weights, experts = seen[0]  # (tokens, top_k) weights and expert indices
    assert weights.shape[-1] == TOP_K == experts.shape[-1]
    assert (weights > 0).all()  # soft at initialisation: both experts carry weight
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[0]))  # renormalised
    _train(model, steps=1)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved[hf.CONFIG_KEY]["gate_kwargs"] == {"entropy_reg": 0.0, "k": 3}
    assert saved[hf.CONFIG_KEY]["renormalize"] is True
    loaded = hf.from_pretrained(transformers.MixtralForCausalLM, tmp_path)
    assert all(r.gate_module.k == 3 for r in _routers(loaded))
    with torch.no_grad():
        want, got = model(input_ids=_ids()).logits, loaded(input_ids=_ids()).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_defaults_are_the_per_token_recipe_and_old_names_are_refused() -> None:
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    routers = hf.replace_routers(model)
    assert all(isinstance(r.gate_module, DSelectK) and r.gate_module.k == 3 for r in routers)
    assert all(r.renormalize and float(r.gate_module.entropy_reg) == 0.0 for r in routers)
    entry = getattr(model.config, hf.CONFIG_KEY)
    assert entry["gate_kwargs"] == {"k": 3} and entry["renormalize"] is True
    topk = hf.replace_routers(model, "topk")  # its k is the model's top_k, not selectors
    assert all(r.gate_module.k == TOP_K for r in topk)
    with pytest.raises(TypeError, match="k= is now selectors="):
        hf.replace_routers(model, "dselect_k", k=3)
    with pytest.raises(TypeError, match="router= is now gate="):
        hf.replace_routers(model, router="dselect_k")
    with pytest.raises(ValueError, match="selectors"):
        hf.replace_routers(model, selectors=0)


def test_entry_of_an_earlier_version_loads_as_saved(tmp_path: Path) -> None:
    """An entry written before the defaults changed (k in gate_kwargs; no renormalize key in the
    oldest) is read as saved: the gate's k and no renormalisation."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(_config("mixtral"))
    hf.replace_routers(model, "dselect_k", selectors=None, renormalize=False)
    entry = getattr(model.config, hf.CONFIG_KEY)
    assert entry["gate_kwargs"] == {"k": TOP_K}
    del entry["renormalize"]
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(transformers.MixtralForCausalLM, tmp_path)
    assert all(r.gate_module.k == TOP_K and not r.renormalize for r in _routers(loaded))
    model.eval(), loaded.eval()
    torch.testing.assert_close(model(input_ids=_ids()).logits, loaded(input_ids=_ids()).logits)
