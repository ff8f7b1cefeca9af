"""Name → gate, with each gate's hyperparameters declared, so configs and the CLI can name and
check every gate without a table of their own.

A :class:`GateSpec` says how to build a gate and which hyperparameters it takes
(:class:`HParam`: type, default, allowed range, whether a schedule may move it during training).
Command-line flags, tuned-file validation, run identities, dry-run plans and report labels are
derived from these declarations (see :mod:`dselectk.variants`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from dselectk._validate import near_miss
from dselectk.gates.ablation import INITS, DSelectKExtended, SoftmaxSelectorGate
from dselectk.gates.base import Gate
from dselectk.gates.comet import COMETGate
from dselectk.gates.dselect_k import DSelectK
from dselectk.gates.gumbel import GumbelSoftmaxGate
from dselectk.gates.softmax import SoftmaxGate
from dselectk.gates.topk import TopKGate

__all__ = [
    "GATES",
    "GateSpec",
    "HParam",
    "gate_names",
    "gate_spec",
    "make_gate",
    "register_gate",
]


@dataclass(frozen=True)
class HParam:
    """One hyperparameter of a gate, as the registry declares it.

    Attributes:
        name: the constructor argument (``gamma``, ``entropy_reg``, ...).
        type: ``float``, ``int``, ``bool`` or ``str``.
        default: the constructor's default.
        low, high: the allowed closed range of a number (None: unbounded on that side).
        positive: a number must be > ``low`` (an open lower end, e.g. γ > 0).
        choices: the allowed values of a ``str``.
        schedulable: a schedule may change it during training (it is a buffer of the gate).
        doc: one line for ``--help`` and reports.

    Examples:
        >>> from dselectk.gates.registry import HParam
        >>> h = HParam("gamma", float, 1.0, low=0.0, positive=True, doc="smooth-step width")
        >>> h.range_text(), h.check(2), h.check([0.5, 1])  # one value, or one per gate of a bank
        ('a number > 0', 2.0, [0.5, 1.0])
        >>> h.check(0.0, where="--gamma")
        Traceback (most recent call last):
            ...
        ValueError: --gamma: expected a number > 0, got 0.0
    """

    name: str
    type: type
    default: Any
    low: float | None = None
    high: float | None = None
    positive: bool = False
    choices: tuple[str, ...] | None = None
    schedulable: bool = False
    doc: str = ""

    def range_text(self) -> str:
        """The allowed values, as an error message or ``--help`` says them."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.type is bool:
            return "true or false"
        lo = "" if self.low is None else f"{'>' if self.positive else '>='} {self.low:g}"
        hi = "" if self.high is None else f"<= {self.high:g}"
        bounds = " and ".join(b for b in (lo, hi) if b)
        return f"a{'n integer' if self.type is int else ' number'}" + (
            f" {bounds}" if bounds else ""
        )

    def check(self, value: Any, where: str = "") -> Any:
        """``value`` converted to the declared type, or a ValueError naming ``where`` (the flag,
        file or key it came from) and the allowed values. A number may also be one value per gate
        of a bank (a sequence); a tensor is passed on unchecked (the gate checks it; reading it
        here would fail on the meta device)."""
        label = where or self.name
        if isinstance(value, Tensor):
            return value
        if isinstance(value, Sequence) and not isinstance(value, str) and self.type is float:
            return [self.check(v, where) for v in value]
        bad = ValueError(f"{label}: expected {self.range_text()}, got {value!r}")
        if self.type is bool:
            if not isinstance(value, bool):
                raise bad
            return value
        if self.type is str:
            if not isinstance(value, str) or (
                self.choices is not None and value not in self.choices
            ):
                raise bad
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad
        if self.type is int and not float(value).is_integer():
            raise bad
        v = self.type(value)
        if not math.isfinite(v):
            raise bad
        if self.low is not None and (v < self.low or (self.positive and v <= self.low)):
            raise bad
        if self.high is not None and v > self.high:
            raise bad
        return v


@dataclass(frozen=True)
class GateSpec:
    """A registered gate: how to build it and the hyperparameters it declares.

    Attributes:
        name: the registry name.
        factory: ``factory(num_experts, **kwargs) -> Gate``.
        hparams: the declared hyperparameters by name.
        takes_k: the gate selects at most ``k`` experts (its constructor takes ``k``).
        summary: one line for listings.

    Examples:
        >>> from dselectk.gates.registry import gate_spec
        >>> spec = gate_spec("comet")
        >>> spec.name, spec.takes_k, spec.schedulable()
        ('comet', True, ['gamma', 'entropy_reg'])
        >>> spec.check({"gamma": 2})
        {'gamma': 2.0}
        >>> spec.build(8, k=2, num_gates=3)().weights.shape  # a bank of 3 static gates: (T, n)
        torch.Size([3, 8])
    """

    name: str
    factory: Callable[..., Gate]
    hparams: Mapping[str, HParam] = field(default_factory=dict)
    takes_k: bool = True
    summary: str = ""

    def schedulable(self) -> list[str]:
        """Names of the hyperparameters a schedule may move."""
        return [n for n, h in self.hparams.items() if h.schedulable]

    def check(self, values: Mapping[str, Any], where: str = "") -> dict[str, Any]:
        """``values`` checked against the declarations; an unknown name is a ValueError that
        lists the gate's hyperparameters."""
        out = {}
        for key, value in values.items():
            if key not in self.hparams:
                raise ValueError(
                    f"{where + ': ' if where else ''}gate {self.name!r} has no hyperparameter "
                    f"{key!r}; it takes {sorted(self.hparams) or 'none'}"
                )
            out[key] = self.hparams[key].check(value, f"{where}.{key}" if where else key)
        return out

    def build(self, num_experts: int, **kwargs: Any) -> Gate:
        """The gate; declared hyperparameters among ``kwargs`` are checked first, the others
        (``k``, ``in_features``, ``num_gates``, ``bias``, ...) go to the constructor as given."""
        for key, value in kwargs.items():
            if key in self.hparams:
                kwargs[key] = self.hparams[key].check(value)
        return self.factory(num_experts, **kwargs)


GATES: dict[str, GateSpec] = {}


def register_gate(
    name: str,
    factory: Callable[..., Gate],
    hparams: Sequence[HParam] = (),
    *,
    takes_k: bool = True,
    summary: str = "",
) -> GateSpec:
    """Register ``factory(num_experts, **kwargs) -> Gate`` under ``name`` with its declared
    hyperparameters; returns the spec.

    Examples:
        >>> from dselectk.gates import TopKGate
        >>> from dselectk.gates.registry import GATES, HParam, make_gate, register_gate
        >>> def top1(num_experts, **kwargs):  # factory(num_experts, **kwargs) -> Gate
        ...     return TopKGate(num_experts, k=1, **kwargs)
        >>> init_std = HParam("init_std", float, 0.01, low=0.0, doc="std of the initial logits")
        >>> spec = register_gate("top1", top1, [init_std], takes_k=False, summary="Top-1")
        >>> make_gate("top1", 4, num_gates=2, init_std=0.1)().weights.shape  # static bank: (T, n)
        torch.Size([2, 4])
        >>> _ = GATES.pop("top1")  # unregister again (this example only)
    """
    if name in GATES:
        raise ValueError(f"a gate named {name!r} is already registered")
    spec = GateSpec(name, factory, {h.name: h for h in hparams}, takes_k, summary)
    GATES[name] = spec
    return spec


def gate_names() -> list[str]:
    """Registered gate names, sorted.

    Examples:
        >>> from dselectk.gates.registry import gate_names
        >>> gate_names()
        ['ablation_annealing', 'ablation_entropy', 'comet', 'dselect_k', 'dselect_k_extended',
         'gumbel_softmax', 'softmax', 'topk']
    """
    return sorted(GATES)


def gate_spec(name: str) -> GateSpec:
    """The spec registered as ``name`` (ValueError listing the names when unknown).

    Examples:
        >>> from dselectk.gates.registry import gate_spec
        >>> gate_spec("topk").hparams["balance_weight"].default
        0.0
        >>> gate_spec("dselectk")
        Traceback (most recent call last):
            ...
        ValueError: unknown gate 'dselectk' (did you mean 'dselect_k'?); expected one of [...]
    """
    if not isinstance(name, str):
        raise TypeError(f"the gate name must be a str, got the {type(name).__name__} {name!r}")
    if name not in GATES:
        raise ValueError(
            f"unknown gate {name!r}{near_miss(name, GATES)}; expected one of {gate_names()}"
        )
    return GATES[name]


def make_gate(name: str, num_experts: int, **kwargs: Any) -> Gate:
    """Build the gate registered as ``name``.

    Args:
        name: one of :func:`gate_names`.
        num_experts: n.
        **kwargs: passed to the gate's constructor (``k``, ``in_features``, ``num_gates``, ...);
            declared hyperparameters are checked against their declarations first.

    Examples:
        >>> import torch
        >>> from dselectk.gates.registry import make_gate
        >>> gate = make_gate("topk", 8, k=2, in_features=16)  # per-example: (B, 16) -> (B, 8)
        >>> out = gate(torch.randn(4, 16))
        >>> out.weights.shape, (out.weights > 0).sum(-1).tolist(), out.aux_loss.shape
        (torch.Size([4, 8]), [2, 2, 2, 2], torch.Size([]))
        >>> make_gate("dselect_k", 8, k=2, num_gates=3).num_gates  # a bank of 3 static gates
        3
        >>> make_gate("dselect_k", 8, k=2, gamma=-1)
        Traceback (most recent call last):
            ...
        ValueError: gamma: expected a number > 0, got -1
    """
    return gate_spec(name).build(num_experts, **kwargs)


def _ablation_annealing(num_experts: int, **kw: Any) -> Gate:
    reg = kw.get("entropy_reg", 0.0)
    values = reg.tolist() if isinstance(reg, Tensor) and reg.device.type != "meta" else reg
    if any(float(v) != 0.0 for v in (values if isinstance(values, list) else [values])):
        raise ValueError("ablation_annealing uses temperature annealing, not entropy_reg")
    return SoftmaxSelectorGate(num_experts, **kw)


_GAMMA = HParam(
    "gamma", float, 1.0, low=0.0, positive=True, schedulable=True, doc="smooth-step width γ"
)
_LAMBDA = HParam("entropy_reg", float, 0.0, low=0.0, schedulable=True, doc="entropy weight λ")
_TAU = HParam(
    "temperature", float, 1.0, low=0.0, positive=True, schedulable=True, doc="temperature τ"
)

_XI = HParam("xi", float, 1.0, low=0.0, doc="weight ξ of the unused-code penalty (App. B.2)")
_DISTINCT = HParam(
    "distinct",
    bool,
    False,
    doc="selectors moved to distinct expert codes by their least confident bits (ours)",
)
register_gate(
    "dselect_k",
    DSelectK,
    [_GAMMA, _LAMBDA, _XI, _DISTINCT],
    summary="DSelect-k (Sec. 3): k binary-encoded selectors, cubic smooth-step",
)
register_gate(
    "dselect_k_extended",
    DSelectKExtended,
    [
        _GAMMA,
        _LAMBDA,
        HParam(
            "diversity",
            float,
            0.0,
            low=0.0,
            schedulable=True,
            doc="selector-diversity weight μ (ours; measured: no gain)",
        ),
        _XI,
        HParam(
            "init",
            str,
            "paper",
            choices=INITS,
            doc="initialisation (paper, or spread: selectors lean to distinct experts; ours)",
        ),
        _DISTINCT,
    ],
    summary="DSelect-k with research options (spread init, selector diversity): no gain measured",
)
register_gate(
    "topk",
    TopKGate,
    [
        HParam("noisy", bool, False, doc="noisy gating (per-example only)"),
        HParam("balance_weight", float, 0.0, low=0.0, doc="load-balancing loss weight"),
        HParam("init_std", float, 0.01, low=0.0, doc="std of the initial static logits"),
    ],
    summary="Top-k (Sec. 2): softmax over the k largest logits",
)
register_gate("softmax", SoftmaxGate, takes_k=False, summary="dense softmax gate (Sec. 2)")
register_gate(
    "gumbel_softmax",
    GumbelSoftmaxGate,
    [
        HParam("sparsity_reg", float, 0.0, low=0.0, schedulable=True, doc="sparsity weight"),
        _TAU,
        HParam("hard", bool, True, doc="straight-through hard mask"),
        HParam("init_keep_logit", float, 2.0, doc="initial keep logit"),
    ],
    takes_k=False,
    summary="Gumbel-softmax gate (App. D)",
)
_SELECTOR_ABLATION = [
    _TAU,
    _LAMBDA,
    HParam("init_std", float, 0.01, low=0.0, doc="std of the initial logits"),
]
register_gate(
    "ablation_entropy",
    SoftmaxSelectorGate,
    _SELECTOR_ABLATION,
    summary="softmax selectors with entropy (App. C.1 ablation)",
)
register_gate(
    "ablation_annealing",
    _ablation_annealing,
    _SELECTOR_ABLATION,
    summary="softmax selectors with temperature annealing (App. C.1 ablation)",
)
register_gate(
    "comet",
    COMETGate,
    [_GAMMA, _LAMBDA],
    summary="COMET tree gate (Ibrahim et al., KDD 2023)",
)
