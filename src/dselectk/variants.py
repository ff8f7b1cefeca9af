"""A gate variant is data: which gate, its fixed options, how its hyperparameters move during
training, whether the swap search runs, and what a report calls it.

Every study builds its models from :class:`Variant` values, so a new variant is a new value, not
new code::

    from dselectk.variants import Ramp, SearchPlan, Variant

    annealed = Variant(
        "dselect_k_anneal", "dselect_k", "DSelect-k, γ annealed",
        schedules=(Ramp("gamma", end_factor=1e-3, delay=0.6, span=0.3, shape="geometric"),),
    )
    gate = annealed.build(16, k=4, num_gates=8, hparams={"gamma": 10.0, "entropy_reg": 0.1})
    scheds = annealed.schedulers(gate, {"gamma": 10.0}, total_steps=2000)

One vocabulary describes every schedule (:class:`~dselectk.schedules.Ramp`, re-exported here
with :func:`~dselectk.schedules.total_steps` and :class:`~dselectk.search.SearchPlan`): a value
held for part of the run, then moved linearly or geometrically to another. The
hyperparameters a variant may take, their types and ranges come from the gate registry
(:func:`dselectk.gates.registry.gate_spec`); :meth:`Variant.check_hparams` validates a tuned file
or the command line against them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from dselectk.gates.base import Gate
from dselectk.gates.registry import GateSpec, gate_spec
from dselectk.schedules import (
    AttributeScheduler,
    GeometricSchedule,
    Ramp,
    Schedule,
    total_steps,
)
from dselectk.search import SearchPlan

__all__ = [
    "Ramp",
    "SearchPlan",
    "Variant",
    "stack_members",
    "total_steps",
    "variant_table",
]

M = TypeVar("M", bound=nn.Module)

#: hyperparameters of a run that are not the gate's (trainer settings every variant accepts)
TRAINER_HPARAMS = ("lr", "epochs")


def _freeze(options: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    items = options.items() if isinstance(options, Mapping) else options
    return tuple(sorted(items))


@dataclass(frozen=True)
class Variant:
    """One gate variant of a study.

    Attributes:
        name: the study's name for it (``--gates`` choices, record keys).
        gate: the registry name of the gate.
        label: what reports call it.
        options: fixed constructor options (a mapping, stored sorted and frozen).
        schedules: how schedulable hyperparameters move during training.
        search: the swap-search plan, or None.
        tuned_as: read tuned hyperparameters under this variant's name (None: its own).
        routing: who chooses in a sparse MoE layer of this gate
            (:class:`~dselectk.layers.SparseMoEFeedForward`): "token" (each token its k
            experts) or "expert" (expert choice: each expert its k·N/n tokens of the batch).

    Examples:
        >>> annealed = Variant(
        ...     "dselect_k_anneal", "dselect_k", "DSelect-k, γ annealed",
        ...     schedules=(Ramp("gamma", end_factor=1e-2, delay=0.5, shape="geometric"),),
        ... )
        >>> gate = annealed.build(8, k=2, num_gates=3, hparams={"gamma": 4.0, "lr": 0.1})
        >>> (sched,) = annealed.schedulers(gate, {"gamma": 4.0}, total_steps=100)
        >>> for _ in range(100):
        ...     sched.step()
        >>> gate.num_gates, round(float(gate.gamma), 6)
        (3, 0.04)
        >>> annealed.identity()["schedules"]
        [{'param': 'gamma', 'end_factor': 0.01, 'delay': 0.5, 'shape': 'geometric'}]
    """

    name: str
    gate: str
    label: str
    options: Any = ()
    schedules: tuple[Ramp, ...] = ()
    search: SearchPlan | None = None
    tuned_as: str | None = None
    routing: str = "token"

    def __post_init__(self) -> None:
        if self.routing not in ("token", "expert"):
            raise ValueError(f"variant {self.name!r}: routing must be 'token' or 'expert'")
        spec = gate_spec(self.gate)
        opts = _freeze(self.options)
        spec.check(dict(opts), where=f"variant {self.name!r} options")
        object.__setattr__(self, "options", opts)
        for ramp in self.schedules:
            if ramp.param not in spec.schedulable():
                raise ValueError(
                    f"variant {self.name!r}: {self.gate} cannot schedule {ramp.param!r}; "
                    f"schedulable: {spec.schedulable()}"
                )

    @property
    def spec(self) -> GateSpec:
        """The gate's registry entry."""
        return gate_spec(self.gate)

    @property
    def tuned_name(self) -> str:
        """The name tuned hyperparameters are looked up under."""
        return self.tuned_as or self.name

    def with_ramps(self, ramps: Iterable[Ramp], params: Iterable[str] | None = None) -> Variant:
        """This variant with ``ramps`` added after its own, keeping only the ramps of the
        hyperparameters in ``params`` (default: those its gate can schedule); itself when none
        is kept (a command line's ramps apply to the variants that take them)."""
        allowed = set(self.spec.schedulable() if params is None else params)
        own = tuple(r for r in ramps if r.param in allowed)
        return replace(self, schedules=(*self.schedules, *own)) if own else self

    def gate_hparams(self, hparams: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of ``hparams`` the gate declares (None values left out: the default)."""
        declared = self.spec.hparams
        return {k: v for k, v in hparams.items() if k in declared and v is not None}

    def check_hparams(self, hparams: Mapping[str, Any], where: str = "") -> dict[str, Any]:
        """``hparams`` checked: trainer settings (``lr``, ``epochs``) and the gate's declared
        hyperparameters; anything else is a ValueError naming ``where`` and the allowed keys."""
        out = dict(hparams)
        at = where or f"hyperparameters of {self.name!r}"
        lr, epochs = hparams.get("lr"), hparams.get("epochs")
        number = (int, float)
        if lr is not None and (
            isinstance(lr, bool) or not isinstance(lr, number) or not math.isfinite(lr) or lr <= 0
        ):
            raise ValueError(f"{at}.lr: expected a finite number > 0, got {lr!r}")
        if epochs is not None and (
            isinstance(epochs, bool)
            or not isinstance(epochs, number)
            or not math.isfinite(epochs)
            or epochs != int(epochs)
            or epochs < 1
        ):
            raise ValueError(f"{at}.epochs: expected an integer >= 1, got {epochs!r}")
        gate_part = {k: v for k, v in hparams.items() if k not in TRAINER_HPARAMS and v is not None}
        out.update(self.spec.check(gate_part, at))
        return out

    def build(
        self,
        num_experts: int,
        *,
        hparams: Mapping[str, Any] | None = None,
        **structure: Any,
    ) -> Gate:
        """The gate: fixed options, then the declared hyperparameters found in ``hparams``
        (other keys such as ``lr`` are ignored), then ``structure`` (``k``, ``in_features``,
        ``num_gates``, ...)."""
        kw: dict[str, Any] = dict(self.options)
        kw.update(self.gate_hparams(hparams or {}))
        if self.spec.takes_k is False:
            structure.pop("k", None)
        kw.update(structure)
        return self.spec.build(num_experts, **kw)

    def schedulers(
        self, gate: Gate, hparams: Mapping[str, Any], total_steps: int
    ) -> list[AttributeScheduler]:
        """One :class:`~dselectk.schedules.AttributeScheduler` per ramp of this variant
        (:meth:`Ramp.scheduler <dselectk.schedules.Ramp.scheduler>`); a ramp's own value is
        ``hparams[param]`` (else the gate's current value)."""
        return [
            ramp.scheduler(gate, total_steps, value=hparams.get(ramp.param))
            for ramp in self.schedules
        ]

    def member_schedulers(
        self,
        gate: Gate,
        members: Sequence[Mapping[str, Any]],
        gates_per_member: int,
        steps_per_epoch: int,
    ) -> list[AttributeScheduler]:
        """The ramps of a gate bank whose members train together with their own
        hyperparameters (a batched grid search): member r owns gates r·G ... r·G + G − 1
        (G = ``gates_per_member``) and ``members[r]`` holds its values (``epochs`` included).

        Each ramp starts at the member's own value (per-gate tensors). A geometric ramp without
        delay or span to a fixed end (an annealing) spans each member's own epochs; any other
        ramp needs all members to run the same epochs (else a ValueError).
        """

        def values(key: str) -> Tensor:  # (R·G,) float64, member r's value over its gates
            v = torch.tensor([float(m.get(key) or 0.0) for m in members], dtype=torch.float64)
            return v.repeat_interleave(gates_per_member)

        totals = values("epochs") * steps_per_epoch
        out = []
        for r in self.schedules:
            start = values(r.param) if r.start is None else r.start
            sched: Schedule
            whole_run = not r.delay and r.delay_steps is None and r.span is None
            if whole_run and r.span_steps is None and r.shape == "geometric" and r.end is not None:
                sched = GeometricSchedule(start, r.end, totals)
            elif bool((totals == totals[0]).all()):
                sched = r.schedule(start, int(totals[0]))
            else:
                raise ValueError(f"{r}: members of different epochs need a geometric ramp")
            out.append(AttributeScheduler(gate, r.param, sched))
        return out

    def identity(self) -> dict[str, Any]:
        """The variant as a run record stores it (what makes two runs the same)."""
        out: dict[str, Any] = {"gate": self.gate}
        if self.options:
            out["options"] = dict(self.options)
        if self.schedules:
            out["schedules"] = [
                {k: v for k, v in asdict(r).items() if v is not None} for r in self.schedules
            ]
        if self.search is not None:
            out["search"] = self.search.identity()
        if self.routing != "token":  # token-routed variants keep the identity they had
            out["routing"] = self.routing
        return out


def variant_table(*variants: Variant) -> dict[str, Variant]:
    """Variants by name (a ValueError on a repeated name).

    Examples:
        >>> table = variant_table(Variant("dk", "dselect_k", "DSelect-k"),
        ...                       Variant("topk", "topk", "Top-k"))
        >>> list(table), table["dk"].gate
        (['dk', 'topk'], 'dselect_k')
    """
    table: dict[str, Variant] = {}
    for v in variants:
        if v.name in table:
            raise ValueError(f"two variants named {v.name!r}")
        table[v.name] = v
    return table


@torch.no_grad()
def stack_members(bank: M, members: Sequence[nn.Module], *, buffers: Iterable[str] = ()) -> M:
    """Load independent members into one vectorized ``bank``: each parameter of the bank is
    the members' parameters of the same name, concatenated member after member along the
    first axis (a single gate's (L,) logits become row r of the bank's (R, L); a bank of T gates
    rows r·T ... r·T + T − 1; E experts of a :class:`~dselectk.layers.StackedMLP` experts
    r·E ...). R repetitions then train as one model, each from the initialisation it gets
    alone. The buffers named in ``buffers`` (frozen experts, masks) are stacked the same way;
    the others (a gate's hyperparameters, say) are the bank's own. Returns ``bank``.
    :func:`dselectk.members.build_bank` builds the members from seeds and calls this.

    Raises:
        ValueError: a member lacks a parameter (or named buffer) of the bank, or the sizes do
            not add up.

    Examples:
        >>> from dselectk.gates import DSelectK
        >>> a, b = DSelectK(4, 2), DSelectK(4, 2)  # two members, logits (6,) each
        >>> bank = stack_members(DSelectK(4, 2, num_gates=2), [a, b])  # logits (2, 6)
        >>> tuple(bank.logits.shape), torch.equal(bank.logits[1], b.logits)
        ((2, 6), True)
    """
    if not members:
        raise ValueError("stack_members needs at least one member")
    names = list(buffers)
    own = dict(bank.named_buffers())
    unknown = [n for n in names if n not in own]
    if unknown:
        raise ValueError(f"stack_members: the bank has no buffer {unknown[0]!r}")
    tensors = [{**dict(m.named_parameters()), **dict(m.named_buffers())} for m in members]
    targets = [*bank.named_parameters(), *((n, own[n]) for n in names)]
    for name, p in targets:
        if any(name not in mp for mp in tensors):
            kind = "parameter" if name not in own else "buffer"
            raise ValueError(f"stack_members: a member has no {kind} {name!r}")
        parts = [mp[name].reshape(-1, *p.shape[1:]) for mp in tensors]
        if sum(q.shape[0] for q in parts) != p.shape[0]:
            raise ValueError(
                f"stack_members: {name!r} of the bank has {p.shape[0]} rows, the members "
                f"{[q.shape[0] for q in parts]}"
            )
        p.copy_(torch.cat(parts))
    return bank
