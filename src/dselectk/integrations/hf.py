"""DSelect-k (or any registered gate) as the router of Hugging Face Mixtral-style MoE blocks.

``replace_routers(model)`` swaps the router (``block.gate``, a ``MixtralTopKRouter``) of every
sparse MoE block of a transformers model (``MixtralForCausalLM`` and models built the same way:
a block with ``.gate`` returning ``(router_logits, top_k_weights, top_k_index)`` and
``.experts``) for a :class:`GateRouter` holding a per-example gate of this package. Nothing
else of the model changes; the experts, their weights and the dispatch are transformers' own.

What the router returns (transformers' contract, checked against ``transformers`` 5.x):

* ``top_k_weights, top_k_index``: the gate's ``top_k`` largest weights per token
  (``top_k = config.num_experts_per_tok``) and their experts. They are *not* renormalised
  (``renormalize=True`` rescales them to sum to 1, as Mixtral's own router does): for DSelect-k
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

The replacement router is an instance of a subclass of the block's original router class, so
transformers' output recorders (``output_router_logits=True``) find it. Replace the routers
before the first forward (or the adapter installs the recording hook on the new routers
itself). The gates are initialised by this package, not by the model's ``_init_weights``; do
not call ``model.init_weights()`` afterwards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dselectk.gates.base import Gate
from dselectk.gates.registry import GATES, make_gate

__all__ = ["GateRouter", "find_moe_blocks", "replace_routers", "router_aux_loss"]

_CLASSES: dict[type, type] = {}
_HOOK_FLAG = "_dselectk_router_hook"


class GateRouter(nn.Module):
    """A transformers MoE router backed by a per-example :class:`~dselectk.gates.Gate`.

    Build it with :func:`replace_routers` (which makes it an instance of the replaced router's
    class too). ``forward(hidden_states)`` takes ``(..., hidden)`` tokens and returns
    ``(router_logits, top_k_weights, top_k_index)`` as described in the module docstring.
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

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalize={self.renormalize}"


def _router_class(base: type) -> type[GateRouter]:
    """``GateRouter`` subclassing the original router class (for transformers' recorders)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Gate{base.__name__}", (GateRouter, base), {})
    return _CLASSES[base]


def find_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` of every Mixtral-style sparse MoE block of ``model``."""
    found = []
    for name, mod in model.named_modules():
        gate = getattr(mod, "gate", None)
        if (
            isinstance(gate, nn.Module)
            and hasattr(mod, "experts")
            and all(hasattr(gate, a) for a in ("top_k", "num_experts", "hidden_dim"))
        ):
            found.append((name, mod))
    return found


def router_aux_loss(model: nn.Module) -> Tensor:
    """Sum of the gates' auxiliary losses of the last forward (0 if none ran)."""
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


def replace_routers(
    model: nn.Module,
    router: str | Any = "dselect_k",
    *,
    aux_loss_weight: float = 1.0,
    renormalize: bool = False,
    **gate_kwargs: Any,
) -> list[GateRouter]:
    """Put a gate of this package in every Mixtral-style MoE block of ``model``.

    Args:
        model: a transformers model (e.g. ``MixtralForCausalLM``); changed in place.
        router: a gate name (built per-example with ``in_features=hidden_size``, n =
            ``num_local_experts`` and, when the gate takes one, ``k = num_experts_per_tok``), or a
            callable ``(num_experts, hidden_size, top_k) -> Gate`` (called once per block).
        aux_loss_weight: weight of the gates' auxiliary losses added to ``outputs.loss``
            (0: not added; use :func:`router_aux_loss`).
        renormalize: rescale each token's top-k weights to sum to 1.
        **gate_kwargs: arguments of the gate when ``router`` is a name (gamma, entropy_reg, ...).

    Returns:
        The new routers, in module order.
    """
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ValueError("model has no Mixtral-style MoE block (a module with .gate and .experts)")
    routers: list[GateRouter] = []
    for _, block in blocks:
        old: Any = block.gate
        n, d, top_k = int(old.num_experts), int(old.hidden_dim), int(old.top_k)
        if isinstance(router, str):
            kw = dict(gate_kwargs)
            if router in GATES and GATES[router].takes_k:
                kw.setdefault("k", top_k)
            gate = make_gate(router, n, in_features=d, **kw)
        else:
            if gate_kwargs:
                raise ValueError("gate keyword arguments only apply when router is a gate name")
            gate = router(n, d, top_k)
        if not isinstance(gate, Gate) or gate.static or gate.num_gates is not None:
            raise ValueError(f"the router must be a per-example single gate, got {gate!r}")
        if gate.num_experts != n or gate.in_features != d:
            raise ValueError(f"gate must have {n} experts and in_features={d}, got {gate!r}")
        p = next(old.parameters(), None)
        if p is not None:
            gate = gate.to(device=p.device, dtype=p.dtype)
        base = type(old)
        cls = _router_class(base)
        new = cls.__new__(cls)
        new._setup(gate, top_k, renormalize)
        block.gate = new
        routers.append(new)
        if getattr(model, "_output_capturing_hooks_installed", False):
            from transformers.utils.output_capturing import install_output_capuring_hook

            install_output_capuring_hook(new, "router_logits", 0)
    if not hasattr(model, _HOOK_FLAG):
        model.register_forward_hook(_add_aux_hook)
    setattr(model, _HOOK_FLAG, float(aux_loss_weight))
    return routers
