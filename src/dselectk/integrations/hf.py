"""DSelect-k (or any registered gate) as the router of Hugging Face transformers MoE models.

``replace_routers(model)`` swaps the router (``block.gate`` or ``block.router``, e.g. a
``MixtralTopKRouter``) of every sparse MoE block of a transformers model for a
:class:`GateRouter` holding a per-example gate of this package. The experts, their weights and
the dispatch stay transformers' own.

Supported families (checked against ``transformers`` 5.24; each tested on a tiny random model in
``tests/test_hf_persistence.py``: built on the meta device, ``init_weights()``, trained, saved,
loaded back with the same logits, greedy ``generate`` with and without the KV cache). They share
Mixtral's router contract: the block calls ``router_logits, top_k_weights, top_k_index =
router(hidden_states)`` on a ``TopKRouter`` with ``top_k``, ``num_experts`` and a
``(num_experts, hidden)`` ``weight``, whose logits are recorded by an ``OutputRecorder`` and fed
to ``load_balancing_loss_func``:

* **Mixtral**, **MiniMax** (``block.gate``),
* **Qwen2-MoE**, **Qwen3-Next** (``block.gate``; the shared expert and its
  ``shared_expert_gate`` are kept as they are), **Qwen3-MoE**,
* **OLMoE**, **FlexOlmo** (``block.gate``),
* **Jamba**, **Granite-MoE**, **GPT-OSS** (``block.router``; GPT-OSS's router bias goes with
  the replaced router).

Not supported, refused by :func:`replace_routers` (a ValueError naming the router and why):
**DeepSeek-V3** / GLM-4-MoE style routers (sigmoid scores, a learned
``e_score_correction_bias``, grouped top-k), **LFM2-MoE** (sigmoid scores and an
``expert_bias`` the block passes to the router), **ERNIE-4.5-MoE** (its router's ``moe_statics``
correction of the selection would be dropped). Families not listed here were not checked; a
block built like Mixtral's is found by :func:`find_moe_blocks`.

Known limit of transformers 5.24 itself: with ``output_router_logits=True`` in the config, a
cached ``generate`` fails inside ``load_balancing_loss_func`` (the attention mask covers the
whole sequence, the router logits the new token), with transformers' routers as with these;
pass ``output_router_logits=False`` to ``generate``.

What the router returns (transformers' contract):

* ``top_k_weights, top_k_index``: the gate's ``top_k`` largest weights per token
  (``top_k = config.num_experts_per_tok``) and their experts, rescaled to sum to 1 by default
  (``renormalize=True``, as Mixtral's own router does). With ``renormalize=False``: for DSelect-k
  with binary bits, at most k weights are nonzero and they already sum to 1, so the block
  computes exactly the dense mixture ``Σ_i w_i E_i(x)``; before that, the weight outside the top
  k is dropped (the same cut as :class:`~dselectk.layers.SparseMoEFeedForward`).
* ``router_logits``: ``log w`` (the gate's weights, clamped at the dtype's smallest normal
  number so that experts with weight 0 give a large negative number, not -inf). Transformers'
  ``load_balancing_loss_func`` (``output_router_logits=True``) applies a softmax to the router
  logits and takes their top k: ``softmax(log w) = w / Σ_j w_j``, so its Switch loss is computed
  on the gate's weights normalised per token, the definition of P used by
  :func:`~dselectk.layers.balance_loss` (its f counts top_k pairs per token, so its value is k
  times ours). Gradients flow through it into the gate.

The gate's own auxiliary loss (DSelect-k's entropy regulariser, ...) is stored by each router
at every forward (:attr:`GateRouter.aux_loss`). A forward hook on the model passed to
:func:`replace_routers` adds ``aux_loss_weight · Σ_routers aux_loss`` to ``outputs.loss``
whenever the model computed a loss (``labels`` given), next to transformers'
``router_aux_loss_coef · aux_loss``; with your own loss, add :func:`router_aux_loss` of the
model yourself.

transformers' contract, the rest of it:

* **Meta device.** The gates read no tensor's value when they are built, so the routers can be
  put in a model on the meta device (``from_pretrained``, ``device_map``, init on meta).
* **Initialisation.** ``replace_routers`` makes every ``PreTrainedModel`` of the tree an
  instance of a subclass (``DSelectK<Name>``) whose ``_init_weights`` gives each router the
  gate's own initialisation (:meth:`~dselectk.gates.Gate.reset_parameters`) and leaves the
  gate's layers to it: ``model.init_weights()``, ``_initialize_missing_keys`` while loading and
  ``_init_weights(module)`` all end with the gate's initialisation. Tensors transformers marked
  as loaded (``_is_hf_initialized``) keep their values.
* **Router logits** are recorded for ``output_router_logits=True`` (the router is also an
  instance of the replaced router class, for transformers' output recorders) and the
  load-balancing loss works as above.
* ``generate`` (with or without the KV cache) and gradient checkpointing work as for the
  original model (tested). ``torch.compile(model, fullgraph=True)`` captures the whole model in
  one graph (the small CPU kernel is the custom operator ``dselectk::small``). Tested: a
  DSelect-k gate's values and gradients (``aot_eager``, eager to float rounding); the forward
  of every family's model built by name, with ``aot_eager`` and with inductor, whose logits
  equal the eager model's to 1e-5 relative plus 1e-6 absolute (the compiled graph sums in
  another order: measured up to 1.2e-7 on logits of size 0.4, a few float32 ulps; Mixtral with
  ``aot_eager`` in the default test run, the others with ``-m slow``); the forward of a Mixtral
  whose routers were replaced (inductor, ``-m slow``). Training steps under compile are not
  tested.

Persistence. ``replace_routers`` with a gate *name* writes the router choice into the model's
config, ``config.dselectk_router`` (:data:`CONFIG_KEY`)::

    {"gate": "dselect_k", "gate_kwargs": {"k": 3, "gamma": 1.0, ...},
     "aux_loss_weight": 1.0, "renormalize": true, "format": 1}

(``gate_kwargs`` are the gate's own arguments: DSelect-k's ``k`` is the ``selectors`` of
:func:`replace_routers`.)

so ``model.save_pretrained(path)`` saves it in ``config.json`` next to the gate tensors
(hyperparameter buffers included: a schedule's current γ or λ is saved and restored).
:func:`from_pretrained` loads such a folder (or a Hub repo) with no manual step: it builds the
model class with DSelect-k routers from the config (through transformers' own
``from_pretrained``: meta device, ``device_map``, ``dtype`` all work) and the logits are those of
the saved model::

    from transformers import AutoModelForCausalLM
    from dselectk.integrations import hf

    model = hf.from_pretrained(AutoModelForCausalLM, "path/or/repo")

A router given as a callable is not recorded (it cannot be rebuilt from a config).

**Loading by name.** The config of such a model is a ``DSelectK<Config>`` (e.g.
``DSelectKMixtralConfig``) saved under the model type ``dselectk_<model_type>``, and importing
this module (or :func:`register`) registers those config classes with ``AutoConfig`` and their
``DSelectK<Model>`` classes with the auto model classes. So plain transformers code loads and
builds these models::

    import dselectk.integrations.hf  # registers the classes
    model = AutoModelForCausalLM.from_pretrained("path")       # DSelect-k routers, same logits
    model = AutoModelForCausalLM.from_config(hf.with_routers(config, "dselect_k", gamma=0.5))

The constructor builds the routers before transformers' ``post_init``, so they are initialised
by ``init_weights`` like every other weight (eager construction, the meta device and
``from_pretrained`` give the same router weights under one seed per module). The family's
weight conversions apply to the new model type, less a renaming of the original router's weight
(Granite-MoE's ``router.layer.weight``, which the gate replaces).

**Without this package**, transformers does not know ``dselectk_<model_type>``, and
``config.json``'s ``auto_map`` names the file ``save_pretrained`` writes beside it
(:data:`AUTO_FILE`, which only imports dselectk); ``AutoModelForCausalLM.from_pretrained`` (or
``AutoConfig``) never builds fresh routers. It raises, in this order (transformers' wording):

1. without ``trust_remote_code``: a ValueError, "The repository <folder> contains custom code
   which must be executed to correctly load the model ... Please pass the argument
   `trust_remote_code=True`" (in an interactive session a ``[y/N]`` prompt first). It names the
   folder, not dselectk: transformers asks this before it looks the model type up whenever
   ``auto_map`` names an ``AutoConfig``, and says nothing of the config. (Without the
   ``auto_map``, its error would name the model type ``dselectk_<model_type>`` but advise
   upgrading transformers, and the route below would be lost.)
2. with ``trust_remote_code=True``: an ImportError, "This modeling file requires the following
   packages that were not found in your environment: dselectk. Run `pip install dselectk`"
   (install dselectk from a clone of its repository).

With dselectk installed but not imported, ``trust_remote_code=True`` loads the model. A folder
saved by the first release of this adapter (the family's own model type) still loads through
:func:`from_pretrained`; plain transformers loads it with fresh softmax routers, which
:func:`check_loaded` detects.

Tested transformers versions: see ``pyproject.toml``'s ``transformers`` extra and
``make test-transformers-floor``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from dselectk.gates.base import Gate
from dselectk.gates.hyperparameter import hyperparameters
from dselectk.gates.registry import GATES, make_gate

__all__ = [
    "CONFIG_KEY",
    "GateRouter",
    "check_loaded",
    "find_moe_blocks",
    "from_pretrained",
    "register",
    "replace_routers",
    "router_aux_loss",
    "router_config",
    "with_routers",
]

#: the config attribute that records the router choice (see the module docstring)
CONFIG_KEY = "dselectk_router"
_FORMAT = 1

_CLASSES: dict[type, type] = {}
_HOOKED: dict[type, type] = {}
_CONFIGS: dict[type, type] = {}
_MODELS_REGISTERED: set[type] = set()
#: the prefix of the ``model_type`` a config with DSelect-k routers is saved under
MODEL_TYPE_PREFIX = "dselectk_"
#: the file ``save_pretrained`` writes next to ``config.json`` (named by its ``auto_map``)
AUTO_FILE = "dselectk_transformers.py"
#: the config classes :func:`register` registers (the supported families)
SUPPORTED_CONFIGS = (
    "MixtralConfig",
    "MiniMaxConfig",
    "Qwen2MoeConfig",
    "Qwen3MoeConfig",
    "Qwen3NextConfig",
    "OlmoeConfig",
    "FlexOlmoConfig",
    "JambaConfig",
    "GraniteMoeConfig",
    "GptOssConfig",
)
_HOOK_FLAG = "_dselectk_router_hook"
_IN_ROUTER = "_dselectk_in_router"


class GateRouter(nn.Module):
    """A transformers MoE router backed by a per-example :class:`~dselectk.gates.Gate`.

    Build it with :func:`replace_routers` (which makes it an instance of the replaced router's
    class too). ``forward(hidden_states)`` takes ``(..., hidden)`` tokens and returns
    ``(router_logits, top_k_weights, top_k_index)`` as described in the module docstring.

    Examples:
        >>> import torch
        >>> from transformers import MixtralConfig, MixtralForCausalLM
        >>> from dselectk.integrations import hf
        >>> config = MixtralConfig(
        ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
        >>> router = hf.replace_routers(MixtralForCausalLM(config))[0]
        >>> isinstance(router, hf.GateRouter), router.num_experts, router.top_k
        (True, 4, 2)
        >>> logits, top_w, top_i = router(torch.randn(3, 16))  # (tokens, hidden)
        >>> logits.shape, top_w.shape, top_i.shape  # (tokens, n), (tokens, top_k), (tokens, top_k)
        (torch.Size([3, 4]), torch.Size([3, 2]), torch.Size([3, 2]))
    """

    aux_loss: Tensor | None

    def _setup(self, gate: Gate, top_k: int, renormalize: bool) -> None:
        nn.Module.__init__(self)
        self.gate_module = gate
        self.top_k = int(top_k)
        self.num_experts = gate.num_experts
        if gate.in_features is None:
            raise ValueError("the router must be a per-example gate (in_features set)")
        self.hidden_dim: int = gate.in_features
        self.renormalize = bool(renormalize)
        self.aux_loss = None
        for m in gate.modules():  # transformers' _init_weights leaves these to the router
            setattr(m, _IN_ROUTER, True)

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = hidden_states.reshape(-1, self.hidden_dim)
        out = self.gate_module(x)
        w = out.weights
        self.aux_loss = out.aux_loss
        tiny = torch.finfo(w.dtype).tiny
        logits = torch.log(w.clamp_min(tiny))
        top_w, top_i = w.topk(self.top_k, dim=-1)
        if self.renormalize:
            top_w = top_w / top_w.sum(-1, keepdim=True).clamp_min(tiny)
        return logits, top_w.to(hidden_states.dtype), top_i

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The gate's own initialisation (:meth:`~dselectk.gates.Gate.reset_parameters`)."""
        self.gate_module.reset_parameters()

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalize={self.renormalize}"


def _router_class(base: type) -> type[GateRouter]:
    """``GateRouter`` subclassing the original router class (for transformers' recorders)."""
    base = getattr(base, "_dselectk_router_base", base)  # replacing a replaced router
    if base not in _CLASSES:
        name = f"Gate{base.__name__}"
        _CLASSES[base] = type(
            name,
            (GateRouter, base),
            {"_dselectk_router_base": base, "__module__": __name__, "__qualname__": name},
        )
        globals().setdefault(name, _CLASSES[base])  # so that it pickles
    return _CLASSES[base]


@torch.no_grad()
def _init_router(router: GateRouter) -> None:
    """The gate's initialisation, keeping the tensors transformers marked as loaded."""
    tensors = [*router.gate_module.parameters(), *router.gate_module.buffers()]
    loaded = [t for t in tensors if getattr(t, "_is_hf_initialized", False)]
    if len(loaded) == len(tensors):
        return
    kept = [(t, t.detach().clone()) for t in loaded]
    router.gate_module.reset_parameters()
    for t, value in kept:
        t.copy_(value)


def _init_weights(self: Any, module: nn.Module) -> None:
    """transformers' ``_init_weights``, with the routers left to their gates."""
    if isinstance(module, GateRouter):
        _init_router(module)
        return
    if getattr(module, _IN_ROUTER, False):
        return
    if any(isinstance(getattr(module, a, None), GateRouter) for a in ROUTER_ATTRIBUTES) and not any(
        True for _ in (*module.parameters(recurse=False), *module.buffers(recurse=False))
    ):
        return  # a MoE block holds nothing of its own (Qwen3-Next initialises block.gate.weight)
    type(self)._dselectk_base._init_weights(self, module)


def _initialize_weights(self: Any, module: nn.Module, is_custom_code: bool = False) -> None:
    """transformers' ``_initialize_weights`` (the per-module step of ``init_weights`` and of
    the loader's ``_initialize_missing_keys``), the routers included: they go through the
    replaced class' own ``_initialize_weights`` (so that whatever wraps it, e.g. a seed per
    module, wraps them too), never through its shortcut for custom code (a router holds no
    tensor of its own, so the shortcut would skip it)."""
    if isinstance(module, GateRouter):
        is_custom_code = False
    type(self)._dselectk_base._initialize_weights(self, module, is_custom_code)


def _is_custom_code(cls: Any) -> bool:
    """The replaced class' answer (this subclass lives outside ``transformers.``)."""
    return bool(cls._dselectk_base.is_custom_code())


def _can_set_experts_implementation(cls: Any) -> bool:
    """The replaced class' answer. transformers reads the source of the class' module for
    ``@use_experts_implementation``; this subclass lives in this module, whose source has none, so
    without this it would fall back to the ``"eager"`` experts (a Python loop over the experts
    hit, which ``torch.compile(fullgraph=True)`` cannot trace, and another summation order than
    the family's default ``"grouped_mm"``)."""
    return bool(cls._dselectk_base._can_set_experts_implementation())


def _can_set_attn_implementation(cls: Any) -> bool:
    """The replaced class' answer (transformers reads the class' module source, as above)."""
    return bool(cls._dselectk_base._can_set_attn_implementation())


def _no_auto_class(cls: Any, auto_class: Any = None) -> None:
    """These classes are registered with the auto classes by :func:`register`; transformers'
    ``register_for_auto_class`` (called when a folder is loaded with ``trust_remote_code``)
    would make ``save_pretrained`` copy this module into the folder."""


def _post_init(self: Any) -> None:
    """Before the replaced class' ``post_init`` (the end of every transformers model's
    constructor, which initialises the weights): the routers the config names, so that
    construction, ``from_config``, ``from_pretrained`` and ``init_weights`` all build and
    initialise them through transformers' own path."""
    if _spec(getattr(self, "config", None)) is not None and any(
        not isinstance(_block_router(block), GateRouter) for _, block in find_moe_blocks(self)
    ):
        _apply_config(self)
    type(self)._dselectk_base.post_init(self)


def _from_pretrained_hooked(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """transformers' ``from_pretrained``, then the gates' hyperparameter records from the
    loaded buffers."""
    out = cls._dselectk_base.from_pretrained.__func__(cls, *args, **kwargs)
    _refresh(out[0] if isinstance(out, tuple) else out)
    return out


def _save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """transformers' ``save_pretrained``, plus :data:`AUTO_FILE` (the file ``config.json``'s
    ``auto_map`` names) when the config names this package's routers."""
    out = type(self)._dselectk_base.save_pretrained(self, save_directory, *args, **kwargs)
    named = getattr(getattr(self, "config", None), CONFIG_KEY, None) is not None
    if named and kwargs.get("is_main_process", True):
        write_auto_file(save_directory)
    return out


def _hooked_class(cls: type) -> type:
    """``DSelectK<Name>``: ``cls`` whose routers are initialised by their gates, whose
    constructor puts in the routers ``config.dselectk_router`` names and whose ``config_class``
    is ``DSelectK<Config>`` (:func:`_config_class`); cls itself when it is one already. Kept
    as a global of this module under its name, so that it pickles."""
    if getattr(cls, "_dselectk_hooked", False):
        return cls
    if cls not in _HOOKED:
        name = f"DSelectK{cls.__name__}"
        attrs: dict[str, Any] = {
            "post_init": _post_init,
            "_init_weights": _init_weights,
            "_initialize_weights": _initialize_weights,
            "is_custom_code": classmethod(_is_custom_code),
            "_can_set_experts_implementation": classmethod(_can_set_experts_implementation),
            "_can_set_attn_implementation": classmethod(_can_set_attn_implementation),
            "from_pretrained": classmethod(_from_pretrained_hooked),
            "save_pretrained": _save_pretrained,
            "register_for_auto_class": classmethod(_no_auto_class),
            "_dselectk_base": cls,
            "_dselectk_hooked": True,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"{cls.__name__} with this package's routers (see {__name__}).",
        }
        config_class = getattr(cls, "config_class", None)
        if isinstance(config_class, type) and getattr(config_class, "model_type", ""):
            attrs["config_class"] = _config_class(config_class)
        hooked = type(name, (cls,), attrs)
        _HOOKED[cls] = hooked
        globals().setdefault(name, hooked)
    return _HOOKED[cls]


def _config_init(self: Any, *args: Any, **kwargs: Any) -> None:
    type(self)._dselectk_base.__init__(self, *args, **kwargs)
    _register_models(type(self))


def _config_class(base: type) -> type:
    """``DSelectK<Config>``: ``base`` (a transformers config class) under the model type
    ``dselectk_<model_type>``, registered with ``AutoConfig``; building one registers the
    ``DSelectK<Model>`` classes of its family with the auto model classes (the first time).
    Plain transformers does not know the model type, so it refuses a folder saved with it
    instead of building the original routers. Kept as a global of this module."""
    if getattr(base, "_dselectk_hooked", False):
        return base
    if base not in _CONFIGS:
        name = f"DSelectK{base.__name__}"
        cls = type(
            name,
            (base,),
            {
                "__init__": _config_init,
                "model_type": MODEL_TYPE_PREFIX + str(base.model_type),  # type: ignore[attr-defined]
                "register_for_auto_class": classmethod(_no_auto_class),
                "_dselectk_base": base,
                "_dselectk_hooked": True,
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"{base.__name__} of a model with this package's routers "
                f"(see {__name__}).",
            },
        )
        _CONFIGS[base] = cls
        globals().setdefault(name, cls)
        _register_config(cls)
    return _CONFIGS[base]


def _register_config(cls: Any) -> None:
    """``AutoConfig`` knows ``cls.model_type``; transformers' weight conversions of the family
    (per-expert checkpoints, renamed prefixes) apply to it, less those that rename the original
    router's weight (which the gate replaces: Granite-MoE's ``router.layer.weight``)."""
    from transformers import AutoConfig

    AutoConfig.register(cls.model_type, cls, exist_ok=True)
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:  # a transformers without weight conversions
        return
    conversions = get_checkpoint_conversion_mapping(cls._dselectk_base.model_type)
    if conversions is None:
        return
    kept = [c for c in conversions if not _renames_router_weight(c)]
    register_checkpoint_conversion_mapping(cls.model_type, kept, overwrite=True)


def _renames_router_weight(conversion: Any) -> bool:
    targets = getattr(conversion, "target_patterns", None) or []
    if isinstance(targets, str):
        targets = [targets]
    return type(conversion).__name__ == "WeightRenaming" and all(
        t.rstrip("$").endswith(("router.weight", "gate.weight")) for t in targets
    )


def _auto_classes() -> list[Any]:
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return [
        a
        for a in vars(modeling_auto).values()
        if isinstance(a, type)
        and issubclass(a, _BaseAutoModelClass)
        and getattr(a, "_model_mapping", None) is not None
    ]


def _register_models(config_cls: Any) -> None:
    """Every auto model class that maps the family's config maps ``config_cls`` to the
    ``DSelectK<Model>`` of the same model class."""
    if config_cls in _MODELS_REGISTERED:
        return
    _MODELS_REGISTERED.add(config_cls)
    base = config_cls._dselectk_base
    for auto in _auto_classes():
        if base not in auto._model_mapping:
            continue
        target = auto._model_mapping[base]
        if isinstance(target, list | tuple):
            target = target[0]
        hooked = _hooked_class(target)
        if getattr(hooked, "config_class", None) is config_cls:
            auto.register(config_cls, hooked, exist_ok=True)


def _auto_map(config_cls: Any) -> dict[str, str]:
    """``config.json``'s ``auto_map``: where transformers finds the classes of this model type
    without this package imported (:data:`AUTO_FILE`, with ``trust_remote_code=True``)."""
    module = AUTO_FILE.removesuffix(".py")
    base = config_cls._dselectk_base
    out = {"AutoConfig": f"{module}.{config_cls.__name__}"}
    for auto in _auto_classes():
        names = getattr(auto._model_mapping, "_model_mapping", {})
        name = names.get(base.model_type) if isinstance(names, Mapping) else None
        if isinstance(name, list | tuple):
            name = name[0]
        if isinstance(name, str):
            out[auto.__name__] = f"{module}.DSelectK{name}"
    return out


_AUTO_FILE_TEXT = '''"""A transformers model whose MoE routers are dselectk gates (DSelect-k, ...).

Loading it needs the dselectk library with its transformers extra (from a clone of its
repository: pip install -e ".[transformers]"; dselectk is not on PyPI). With dselectk
installed, ``import dselectk.integrations.hf`` registers these classes with transformers' auto
classes, and ``AutoModelForCausalLM.from_pretrained(folder)`` (or ``AutoModel``, ...) loads the
model with its routers; without the import, pass ``trust_remote_code=True`` (this file only
imports dselectk). See dselectk.integrations.hf.
"""

import dselectk.integrations.hf as _hf


def __getattr__(name):
    return getattr(_hf, name)
'''


def write_auto_file(save_directory: Any) -> None:
    """Write :data:`AUTO_FILE` into ``save_directory`` (``save_pretrained`` of a model with
    this package's routers does it)."""
    import os

    with open(os.path.join(os.fspath(save_directory), AUTO_FILE), "w", encoding="utf-8") as f:
        f.write(_AUTO_FILE_TEXT)


def _set_config_class(config: Any, dselectk: bool) -> None:
    """Make ``config`` a ``DSelectK<Config>`` (its model type and ``auto_map`` with it), or
    back to the plain config class."""
    cls = type(config)
    hooked = getattr(cls, "_dselectk_hooked", False)
    if dselectk and not hooked and getattr(cls, "model_type", ""):
        config.__class__ = _config_class(cls)
        _register_models(config.__class__)
        config.auto_map = {**(getattr(config, "auto_map", None) or {}), **_auto_map(type(config))}
    elif not dselectk and hooked:
        ours = _auto_map(cls)
        config.__class__ = cls._dselectk_base
        rest = {k: v for k, v in (getattr(config, "auto_map", None) or {}).items() if k not in ours}
        if rest:
            config.auto_map = rest
        elif hasattr(config, "auto_map"):
            with contextlib.suppress(AttributeError):
                delattr(config, "auto_map")
    else:
        return
    if "model_type" in vars(config):  # loaded from a dict: the class' model type, not its own
        vars(config)["model_type"] = type(config).model_type


def _hook_init(model: nn.Module) -> None:
    """Make every ``PreTrainedModel`` of ``model``'s tree initialise the routers by their gates."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # a plain torch model: nothing calls _init_weights
        return
    for m in model.modules():
        if isinstance(m, PreTrainedModel) and not getattr(type(m), "_dselectk_hooked", False):
            m.__class__ = _hooked_class(type(m))
            _register_outputs(m)


def _register_outputs(model: Any) -> None:
    """transformers keys the outputs a model records (router logits, ...) on its class' name;
    register them for the new class too."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # another transformers version: nothing to register
        return
    _CAN_RECORD_REGISTRY[model] = getattr(model, "_can_record_outputs", None)


#: the attribute of a MoE block that holds its router, in the order they are looked for
ROUTER_ATTRIBUTES = ("gate", "router")


def _router_attribute(block: nn.Module) -> str | None:
    """The attribute holding ``block``'s top-k router (one with ``top_k``, ``num_experts`` and a
    ``hidden_dim`` or a ``(num_experts, hidden)`` ``weight``), or None."""
    if not hasattr(block, "experts"):
        return None
    for attr in ROUTER_ATTRIBUTES:
        router = getattr(block, attr, None)
        if isinstance(router, nn.Module) and all(
            hasattr(router, a) for a in ("top_k", "num_experts")
        ):
            if hasattr(router, "hidden_dim") or _weight_hidden(router) is not None:
                return attr
    return None


#: router attributes that mark another routing contract than Mixtral's (see the docstring)
_OTHER_CONTRACT = {
    "e_score_correction_bias": "sigmoid scores with a learned selection bias (DeepSeek-V3 style)",
    "use_expert_bias": "sigmoid scores with an expert bias passed by the block (LFM2-MoE)",
    "moe_statics": "a statistics correction of the selection (ERNIE-4.5-MoE)",
}


def _weight_hidden(router: nn.Module) -> int | None:
    weight = getattr(router, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return int(weight.shape[1])
    return None


def find_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` of every Mixtral-style sparse MoE block of ``model``: a module with
    ``.experts`` and a top-k router in ``.gate`` or ``.router`` (:data:`ROUTER_ATTRIBUTES`).

    Examples:
        >>> from transformers import MixtralConfig, MixtralForCausalLM
        >>> from dselectk.integrations import hf
        >>> config = MixtralConfig(
        ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
        >>> [name for name, block in hf.find_moe_blocks(MixtralForCausalLM(config))]
        ['model.layers.0.mlp', 'model.layers.1.mlp']
    """
    return [(name, m) for name, m in model.named_modules() if _router_attribute(m) is not None]


def _block_router(block: nn.Module) -> Any:
    attr = _router_attribute(block)
    assert attr is not None
    return getattr(block, attr)


def router_aux_loss(model: nn.Module) -> Tensor:
    """Sum of the gates' auxiliary losses of the last forward (0 if none ran).

    Examples:
        >>> import torch
        >>> from transformers import MixtralConfig, MixtralForCausalLM
        >>> from dselectk.integrations import hf
        >>> config = MixtralConfig(
        ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
        >>> model = MixtralForCausalLM(config)
        >>> _ = hf.replace_routers(model, entropy_reg=0.1, aux_loss_weight=0)  # you add it
        >>> out = model(torch.randint(0, 32, (2, 5)))  # (batch, seq) token ids
        >>> aux = hf.router_aux_loss(model)  # add it to your own loss
        >>> aux.shape, aux.item() > 0
        (torch.Size([]), True)
    """
    losses = [
        m.aux_loss for m in model.modules() if isinstance(m, GateRouter) and m.aux_loss is not None
    ]
    if not losses:
        p = next(model.parameters(), None)
        return torch.zeros((), device=None if p is None else p.device)
    return torch.stack([loss.float() for loss in losses]).sum()


def _add_aux_hook(model: nn.Module, args: Any, output: Any) -> Any:
    loss = getattr(output, "loss", None)
    weight = getattr(model, _HOOK_FLAG, 0.0)
    if loss is None or weight == 0:
        return output
    output.loss = loss + weight * router_aux_loss(model).to(loss.device, loss.dtype)
    return output


def _json_value(name: str, value: Any) -> Any:
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    raise TypeError(
        f"gate argument {name}={value!r} cannot be saved in the model's config (a number, bool "
        "or string is needed); pass it as a plain value"
    )


#: keyword arguments of earlier versions and what replaced them (a TypeError names the new one)
_RENAMED = {
    "router": "gate= (a gate name or a callable building one)",
    "k": "selectors= (DSelect-k's selector count; the experts per token are the model's top_k)",
}


def _check_renamed(where: str, gate_kwargs: Mapping[str, Any]) -> None:
    for key in gate_kwargs:
        if key in _RENAMED:
            raise TypeError(f"{where}: {key}= is now {_RENAMED[key]}")


def _selector_kwargs(gate: str, selectors: int | None, gate_kwargs: dict[str, Any]) -> None:
    """Put ``selectors`` into ``gate_kwargs`` as the gate's ``k`` for selector gates (DSelect-k,
    COMET, the ablations; not ``"topk"``, whose k is the model's ``top_k``)."""
    if selectors is not None and not (isinstance(selectors, int) and selectors >= 1):
        raise ValueError(f"selectors must be None or an int >= 1, got {selectors!r}")
    if gate in GATES and GATES[gate].takes_k and gate != "topk" and selectors is not None:
        gate_kwargs["k"] = selectors


def router_config(
    gate: str = "dselect_k",
    *,
    selectors: int | None = 3,
    aux_loss_weight: float = 1.0,
    renormalize: bool = True,
    **gate_kwargs: Any,
) -> dict[str, Any]:
    """The ``config.dselectk_router`` entry for these :func:`replace_routers` arguments.

    >>> router_config()["gate_kwargs"], router_config()["renormalize"]
    ({'k': 3}, True)
    """
    _check_renamed("router_config", gate_kwargs)
    if gate not in GATES:
        raise ValueError(f"unknown gate {gate!r}; expected one of {sorted(GATES)}")
    _selector_kwargs(gate, selectors, gate_kwargs)
    return _entry(gate, aux_loss_weight, renormalize, gate_kwargs)


def _entry(
    gate: str, aux_loss_weight: float, renormalize: bool, gate_kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "gate": gate,
        "gate_kwargs": {k: _json_value(k, v) for k, v in sorted(gate_kwargs.items())},
        "aux_loss_weight": float(aux_loss_weight),
        "renormalize": bool(renormalize),
        "format": _FORMAT,
    }


def with_routers(
    config: Any,
    gate: str = "dselect_k",
    *,
    selectors: int | None = 3,
    aux_loss_weight: float = 1.0,
    renormalize: bool = True,
    **gate_kwargs: Any,
) -> Any:
    """A copy of a transformers ``config`` that names these routers: a ``DSelectK<Config>``
    (model type ``dselectk_<model_type>``) with ``config.dselectk_router`` set, so that
    ``AutoModelForCausalLM.from_config(...)`` (or any auto class of the family) builds the model
    with this package's routers, initialised through transformers' ``init_weights``. Arguments
    as for :func:`replace_routers` (a gate name only).

    Examples:
        >>> from transformers import AutoModelForCausalLM, MixtralConfig
        >>> from dselectk.integrations import hf
        >>> config = MixtralConfig(
        ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
        >>> new = hf.with_routers(config, "dselect_k", gamma=0.5)
        >>> type(new).__name__, new.model_type, new.dselectk_router["gate_kwargs"]
        ('DSelectKMixtralConfig', 'dselectk_mixtral', {'gamma': 0.5, 'k': 3})
        >>> model = AutoModelForCausalLM.from_config(new)
        >>> type(model).__name__, isinstance(model.model.layers[0].mlp.gate, hf.GateRouter)
        ('DSelectKMixtralForCausalLM', True)
    """
    import copy

    _check_supported_config(config)
    new = copy.deepcopy(config)
    entry = router_config(
        gate,
        selectors=selectors,
        aux_loss_weight=aux_loss_weight,
        renormalize=renormalize,
        **gate_kwargs,
    )
    setattr(new, CONFIG_KEY, entry)
    _set_config_class(new, True)
    return new


def _check_supported_config(config: Any) -> None:
    """A TypeError unless ``config`` is a transformers config, a ValueError unless its class (or
    a base of it) is one of :data:`SUPPORTED_CONFIGS` (a family whose routers this module
    replaces): a config of a model without MoE blocks would otherwise be credited with routers
    it never gets."""
    from transformers import PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        raise TypeError(
            f"config: expected a transformers PretrainedConfig (e.g. MixtralConfig), "
            f"got {type(config).__name__}"
        )
    if not any(c.__name__ in SUPPORTED_CONFIGS for c in type(config).__mro__):
        raise ValueError(
            f"config: {type(config).__name__} is not a supported MoE family; with_routers takes "
            f"one of {', '.join(SUPPORTED_CONFIGS)} (for a model already built, "
            "replace_routers finds its MoE blocks)"
        )


def replace_routers(
    model: nn.Module,
    gate: str | Callable[[int, int, int], Gate] = "dselect_k",
    *,
    selectors: int | None = 3,
    aux_loss_weight: float = 1.0,
    renormalize: bool = True,
    **gate_kwargs: Any,
) -> list[GateRouter]:
    """Put a gate of this package in every Mixtral-style MoE block of ``model``.

    Works on a model on any device, the meta device included (the gates are built there). With
    a gate name, the choice is written to ``model.config.dselectk_router`` (see
    :func:`from_pretrained`), and the model's ``_init_weights`` initialises the routers by their
    gates (see the module docstring). The defaults are the per-token setting that measured best
    in our character-level study: DSelect-k with λ = 0 (its default ``entropy_reg``), three
    selectors for the model's top-2 dispatch, renormalised.

    Args:
        model: a transformers model (e.g. ``MixtralForCausalLM``); changed in place.
        gate: a gate name (built per-example with ``in_features=hidden_size``, n =
            ``num_experts``; ``"topk"`` with ``k = num_experts_per_tok``, selector gates with
            ``k = selectors``), or a callable ``(num_experts, hidden_size, top_k) -> Gate``
            (called once per block; not recorded in the config).
        selectors: the selector count of DSelect-k (and the other selector gates: COMET, the
            ablations) when ``gate`` is a name; None: the model's ``num_experts_per_tok``.
            Each token still goes to ``num_experts_per_tok`` experts (the largest weights).
        aux_loss_weight: weight of the gates' own auxiliary losses (DSelect-k's entropy term,
            ...) added to ``outputs.loss`` (a finite number >= 0; 0: not added, use
            :func:`router_aux_loss`); the model's load-balancing loss keeps its own
            ``router_aux_loss_coef``.
        renormalize: rescale each token's top-k weights to sum to 1 (as Mixtral's router does;
            a bool).
        **gate_kwargs: arguments of the gate when ``gate`` is a name (gamma, entropy_reg, ...);
            numbers, bools or strings (they are saved in the config).

    Returns:
        The new routers, in module order.

    Examples:
        >>> import torch
        >>> from transformers import MixtralConfig, MixtralForCausalLM
        >>> from dselectk.integrations import hf
        >>> config = MixtralConfig(
        ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
        >>> model = MixtralForCausalLM(config)  # tiny and random: 2 MoE blocks of 4 experts, top-2
        >>> routers = hf.replace_routers(model)  # DSelect-k, λ = 0, 3 selectors, renormalised
        >>> len(routers), type(model).__name__, model.config.dselectk_router["gate_kwargs"]
        (2, 'DSelectKMixtralForCausalLM', {'k': 3})
        >>> ids = torch.randint(0, 32, (2, 5))  # (batch, seq)
        >>> out = model(ids, labels=ids)  # the gates' auxiliary losses are added to out.loss
        >>> out.logits.shape, out.loss.shape
        (torch.Size([2, 5, 32]), torch.Size([]))
        >>> _ = hf.replace_routers(model, "topk")  # transformers' routing, our gate
        >>> model.config.dselectk_router["gate"]
        'topk'
    """
    _check_renamed("replace_routers", gate_kwargs)
    if not isinstance(gate, str) and gate_kwargs:
        raise ValueError("gate keyword arguments only apply when gate is a gate name")
    kw = dict(gate_kwargs)
    if isinstance(gate, str):
        _selector_kwargs(gate, selectors, kw)
    return _replace(model, gate, aux_loss_weight, renormalize, kw)


def _replace(
    model: nn.Module,
    gate_spec: str | Callable[[int, int, int], Gate],
    aux_loss_weight: float,
    renormalize: bool,
    gate_kwargs: dict[str, Any],
) -> list[GateRouter]:
    """:func:`replace_routers` with the gate's own arguments (``k`` included), as saved."""
    if isinstance(aux_loss_weight, bool) or not isinstance(aux_loss_weight, numbers.Real):
        raise TypeError(
            f"aux_loss_weight must be a finite number >= 0, got {type(aux_loss_weight).__name__}"
        )
    if not (math.isfinite(aux_loss_weight) and aux_loss_weight >= 0):
        raise ValueError(f"aux_loss_weight must be a finite number >= 0, got {aux_loss_weight}")
    if not isinstance(renormalize, bool):  # 'no' would read as True
        raise TypeError(f"renormalize must be True or False, got {renormalize!r}")
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ValueError("model has no Mixtral-style MoE block (a module with .gate and .experts)")
    routers: list[GateRouter] = []
    resolved: dict[str, Any] = dict(gate_kwargs)
    for _, block in blocks:
        attr = _router_attribute(block)
        assert attr is not None
        old: Any = getattr(block, attr)
        for marker, why in _OTHER_CONTRACT.items():
            if hasattr(old, marker) and not isinstance(old, GateRouter):
                raise ValueError(
                    f"{type(old).__name__} routes with {why}; replace_routers supports routers "
                    "with Mixtral's contract (softmax, top-k) only"
                )
        hidden = getattr(old, "hidden_dim", None)
        d = int(hidden) if hidden is not None else int(_weight_hidden(old) or 0)
        n, top_k = int(old.num_experts), int(old.top_k)
        p = next(old.parameters(), None)
        on_meta = p is not None and p.is_meta
        # Built on the meta device when the model is there (no value exists there); otherwise
        # on the default device and moved, as before (the same random draws).
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            if isinstance(gate_spec, str):
                kw = dict(gate_kwargs)
                if gate_spec in GATES and GATES[gate_spec].takes_k:
                    kw.setdefault("k", top_k)
                    resolved.setdefault("k", kw["k"])
                gate = make_gate(gate_spec, n, in_features=d, **kw)
            else:
                gate = gate_spec(n, d, top_k)
        if not isinstance(gate, Gate) or gate.static or gate.num_gates is not None:
            raise ValueError(f"the router must be a per-example single gate, got {gate!r}")
        if gate.num_experts != n or gate.in_features != d:
            raise ValueError(f"gate must have {n} experts and in_features={d}, got {gate!r}")
        if p is not None:
            gate = gate.to(device=p.device, dtype=p.dtype)
        cls = _router_class(type(old))
        new = cls.__new__(cls)
        new._setup(gate, top_k, renormalize)
        setattr(block, attr, new)
        routers.append(new)
        if getattr(model, "_output_capturing_hooks_installed", False):
            from transformers.utils.output_capturing import install_output_capuring_hook

            install_output_capuring_hook(new, "router_logits", 0)
    if not hasattr(model, _HOOK_FLAG):
        model.register_forward_hook(_add_aux_hook)
    setattr(model, _HOOK_FLAG, float(aux_loss_weight))
    _hook_init(model)
    config = getattr(model, "config", None)
    if config is not None:
        if isinstance(gate_spec, str):
            entry = _entry(gate_spec, aux_loss_weight, renormalize, resolved)
            setattr(config, CONFIG_KEY, entry)
            _set_config_class(config, True)
        else:
            if hasattr(config, CONFIG_KEY):
                delattr(config, CONFIG_KEY)  # a callable's gates cannot be rebuilt from the config
            _set_config_class(config, False)
    return routers


def _spec(config: Any) -> Mapping[str, Any] | None:
    spec = getattr(config, CONFIG_KEY, None)
    if spec is None:
        return None
    if not isinstance(spec, Mapping) or "gate" not in spec:
        raise ValueError(f"config.{CONFIG_KEY} must be a mapping with a 'gate', got {spec!r}")
    if int(spec.get("format", _FORMAT)) > _FORMAT:
        raise ValueError(
            f"config.{CONFIG_KEY} has format {spec['format']}, newer than this dselectk "
            f"understands ({_FORMAT}); upgrade dselectk"
        )
    return spec


def _apply_config(model: nn.Module) -> None:
    spec = _spec(getattr(model, "config", None))
    if spec is None:
        return
    # The saved gate arguments are the gate's own (``k`` included), read as saved; an entry
    # without ``renormalize`` predates it and was not renormalised.
    _replace(
        model,
        str(spec["gate"]),
        float(spec.get("aux_loss_weight", 1.0)),
        bool(spec.get("renormalize", False)),
        dict(spec.get("gate_kwargs", {})),
    )


def _refresh(model: nn.Module) -> None:
    """Hyperparameter records and flags from the loaded buffers (the loader writes the tensors
    directly, without :meth:`~torch.nn.Module.load_state_dict`)."""
    for m in model.modules():
        if isinstance(m, Gate):
            for hp in hyperparameters(m).values():
                hp.refresh(m)


def from_pretrained(cls: Any, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
    """Load a model saved with DSelect-k routers (the documented loading path).

    Args:
        cls: a model class (``MixtralForCausalLM``, ...) or an auto class
            (``AutoModelForCausalLM``, ...; resolved from the folder's config).
        pretrained_model_name_or_path, *args, **kwargs: as for transformers' ``from_pretrained``
            (``config``, ``dtype``, ``device_map``, ...).

    Returns:
        The model, with the routers its config names (``config.dselectk_router``), every tensor
        loaded from the checkpoint. A folder without ``dselectk_router`` loads as transformers
        would load it (plain routers).

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM
        >>> from dselectk.integrations import hf
        >>> config = MixtralConfig(
        ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
        >>> model = MixtralForCausalLM(config)
        >>> _ = hf.replace_routers(model, gamma=0.5)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     model.save_pretrained(d)
        ...     loaded = hf.from_pretrained(AutoModelForCausalLM, d)
        >>> type(loaded).__name__, loaded.config.dselectk_router["gate_kwargs"]
        ('DSelectKMixtralForCausalLM', {'gamma': 0.5, 'k': 3})
        >>> saved = loaded.state_dict()  # every tensor as saved, the routers' included
        >>> all(torch.equal(t, saved[name]) for name, t in model.state_dict().items())
        True
    """
    config = kwargs.pop("config", None)
    if config is None:
        from transformers import AutoConfig

        _register_saved_type(pretrained_model_name_or_path)

        config = AutoConfig.from_pretrained(
            pretrained_model_name_or_path,
            **{k: kwargs[k] for k in ("revision", "cache_dir", "token") if k in kwargs},
        )
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is not None:  # an auto class
        cls = mapping[type(config)]
    target: Any = _hooked_class(cls) if _spec(config) is not None else cls
    model = target.from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)
    _refresh(model)
    return model


def _register_saved_type(path: Any) -> None:
    """A local folder saved under ``dselectk_<model_type>`` of a family :func:`register` does not
    list: its ``DSelectK<Config>``, so that ``AutoConfig`` knows it."""
    import json
    import os

    file = os.path.join(os.fspath(path), "config.json") if os.path.isdir(path) else None
    if file is None or not os.path.isfile(file):
        return
    with open(file, encoding="utf-8") as f:
        model_type = str(json.load(f).get("model_type", ""))
    if model_type.startswith(MODEL_TYPE_PREFIX):
        from transformers import CONFIG_MAPPING

        base = model_type.removeprefix(MODEL_TYPE_PREFIX)
        if model_type not in CONFIG_MAPPING and base in CONFIG_MAPPING:
            _config_class(CONFIG_MAPPING[base])


def register() -> None:
    """Register the ``DSelectK<Config>`` of every supported family (:data:`SUPPORTED_CONFIGS`)
    with ``AutoConfig`` (and, once such a config is built, the ``DSelectK<Model>`` classes with
    the auto model classes). Importing this module calls it when transformers is installed;
    calling it again does nothing.

    Examples:
        >>> from transformers import AutoConfig
        >>> from dselectk.integrations import hf
        >>> hf.register()  # done when this module is imported; calling it again does nothing
        >>> type(AutoConfig.for_model("dselectk_mixtral")).__name__
        'DSelectKMixtralConfig'
    """
    import transformers

    for name in SUPPORTED_CONFIGS:
        base = getattr(transformers, name, None)
        if isinstance(base, type):
            _config_class(base)


def check_loaded(model: nn.Module) -> None:
    """Raise a ValueError if ``model``'s config names DSelect-k routers that it does not have
    (it was loaded by plain transformers: its routers are freshly initialised softmax routers).

    Examples:
        >>> from transformers import MixtralConfig, MixtralForCausalLM
        >>> from dselectk.integrations import hf
        >>> config = MixtralConfig(
        ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
        >>> model = MixtralForCausalLM(config)
        >>> _ = hf.replace_routers(model)
        >>> hf.check_loaded(model)  # the routers its config names: nothing to say
        >>> plain = MixtralForCausalLM(hf.with_routers(config))  # as plain transformers builds it
        >>> hf.check_loaded(plain)
        Traceback (most recent call last):
            ...
        ValueError: this model was saved with 'dselect_k' routers ... Load it with
        dselectk.integrations.hf.from_pretrained(cls, path).
    """
    spec = _spec(getattr(model, "config", None))
    if spec is None:
        return
    blocks = find_moe_blocks(model)
    plain = [name for name, block in blocks if not isinstance(_block_router(block), GateRouter)]
    if plain:
        raise ValueError(
            f"this model was saved with {spec['gate']!r} routers (config.{CONFIG_KEY}) but "
            f"{len(plain)} MoE block(s) have transformers' own router (e.g. {plain[0]}): it was "
            "loaded without dselectk, and those routers are untrained. Load it with "
            "dselectk.integrations.hf.from_pretrained(cls, path)."
        )


def __getattr__(name: str) -> type:
    """``DSelectK<Name>`` and ``Gate<Router>`` classes made on demand, so that a model pickled
    by another process (``torch.save(model)``) unpickles here."""
    import sys

    for prefix, make in (("DSelectK", _hooked_class), ("Gate", _router_class)):
        if name.startswith(prefix) and len(name) > len(prefix):
            base_name = name[len(prefix) :]
            import transformers

            base = getattr(transformers, base_name, None)
            if base is None:  # a router class: in an already imported modeling module
                for mod_name, mod in list(sys.modules.items()):
                    if mod_name.startswith("transformers.models.") and hasattr(mod, base_name):
                        base = getattr(mod, base_name)
                        break
            if isinstance(base, type):
                if (
                    prefix == "DSelectK"
                    and hasattr(base, "model_type")
                    and hasattr(base, "to_dict")
                ):
                    return _config_class(base)  # a config class
                return make(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


with contextlib.suppress(ImportError):  # transformers installed: the auto classes know ours
    register()
