"""Member banks: R independent models, each built from its own seed, trained side by side as one.

A study that repeats a small model R times (repetitions, restarts, the configurations of a grid
search) holds the R *members* in one *bank*: every parameter of the bank is the members'
parameters of the same name, concatenated member after member along the first axis
(:func:`~dselectk.variants.stack_members`), and one optimizer step per mini-batch trains them
all. The members share nothing but the batches and their loss is the sum of theirs, so with an
elementwise optimizer (Adam; :class:`~dselectk.optim.RowwiseAdam` when their learning rates
differ) each member follows the trajectory it follows alone.

Two calls make a study's bank:

* :func:`build_bank` builds member r under ``torch.manual_seed(seeds[r])`` exactly as the model
  would be built alone, then the bank, and loads the members into it;
* :func:`train_bank` trains it with each member's own hyperparameters (learning rate, epochs,
  the gate's γ, λ, temperature, ...), the variant's schedules (:class:`~dselectk.variants.Ramp`)
  and its swap search (:class:`~dselectk.variants.SearchPlan`), which searches every member's
  gates (each scored by its own loss).

:class:`~dselectk.models.MoEBank` (R multi-gate MoEs with static gates) is the bank the library
provides; any module whose parameters are laid out member-major works (its search then needs
a ``search_loss``). A runnable example, three members of 4 tasks and 8 experts, each with its own
learning rate and γ, searched after half of the steps::

    import torch
    from dselectk.layers import StackedMLP
    from dselectk.members import build_bank, per_gate_hparams, train_bank
    from dselectk.models import MoEBank
    from dselectk.training import TaskData
    from dselectk.variants import SearchPlan, Variant

    T, E = 4, 8
    v = Variant("dsk", "dselect_k", "DSelect-k", search=SearchPlan(at=(0.5,), binarize=0.5))
    members = [{"lr": 0.01, "gamma": 1.0}, {"lr": 0.03, "gamma": 2.0}, {"lr": 0.1, "gamma": 5.0}]

    def make(r):  # member r alone (r: an index into the seeds), or the bank (r None)
        n = len(members) if r is None else 1
        hp = per_gate_hparams(members, T) if r is None else members[r]
        gates = v.build(E, hparams=hp, k=2, num_gates=n * T)
        return MoEBank(StackedMLP(n * E, 10, [4], final_activation=True), gates, members=n)

    bank = build_bank(make, seeds=[0, 1, 2])
    x, y = torch.randn(512, 10), torch.randn(512, T)  # y: (N, T), one column per task
    train_bank(bank, TaskData(x, [y]), {"epochs": 3}, member_hparams=members, variant=v,
               batch_size=64, shuffle_seed=0)
    bank.mse(x, y, bank.inference_weights())  # (R,): each member's MSE
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from numbers import Real
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from dselectk.gates.base import Gate
from dselectk.models.bank import MoEBank
from dselectk.optim import RowwiseAdam
from dselectk.training import BatchLossFn, Callback, History, TaskData, TrainConfig, train
from dselectk.variants import Variant, stack_members

__all__ = ["bank_loss", "build_bank", "per_gate_hparams", "train_bank"]

M = TypeVar("M", bound=nn.Module)


def build_bank(
    make: Callable[[int | None], M], seeds: Sequence[int], *, buffers: Iterable[str] = ()
) -> M:
    """R members, member r initialised under its own seed, as one bank.

    For r = 0 ... R − 1 (R = ``len(seeds)``), ``torch.manual_seed(seeds[r])`` then
    ``make(r)`` builds member r alone: the model a run under that seed starts from. Then
    ``make(None)`` builds the bank of all R members, and the members' parameters (and the
    buffers named in ``buffers``, e.g. frozen experts) are loaded into it with
    :func:`~dselectk.variants.stack_members`: a parameter of shape (c, ...) per member becomes
    rows r·c ... r·c + c − 1 of the bank's (R·c, ...).

    ``make(r)`` may read member r's own hyperparameters (see the module's example); the bank's
    gate hyperparameters are then one value per gate (:func:`per_gate_hparams`). The global
    RNG is left as ``make(None)`` leaves it.

    Args:
        make: ``make(r)`` member r alone; ``make(None)`` the bank of ``len(seeds)`` members.
        seeds: one initialisation seed per member.
        buffers: names of buffers stacked like the parameters.

    Returns:
        The bank.

    Raises:
        ValueError: no seeds, or the members' parameters do not add up to the bank's.
        TypeError: a seed is not an integer.

    Examples:
        >>> from dselectk import DSelectK, MoEBank
        >>> from dselectk.layers import StackedMLP
        >>> def make(r):  # member r alone (4 experts, 2 tasks), or the bank of 3 (r None)
        ...     n = 3 if r is None else 1
        ...     return MoEBank(StackedMLP(n * 4, 10, [4]), DSelectK(4, k=2, num_gates=n * 2), n)
        >>> bank = build_bank(make, seeds=[0, 1, 2])
        >>> _ = torch.manual_seed(1)
        >>> torch.equal(bank.gates.logits[2:4], make(1).gates.logits)  # member 1: gates 2, 3
        True
    """
    if len(seeds) == 0:
        raise ValueError("build_bank: seeds must hold at least one seed")
    members = []
    for r, seed in enumerate(seeds):
        if isinstance(seed, bool) or not hasattr(type(seed), "__index__"):
            raise TypeError(f"build_bank: seeds[{r}] must be an int, got {type(seed).__name__}")
        torch.manual_seed(int(seed))
        members.append(make(r))
    return stack_members(make(None), members, buffers=buffers)


def per_gate_hparams(
    members: Sequence[Mapping[str, Any]],
    gates_per_member: int,
    names: Iterable[str] | None = None,
) -> dict[str, Tensor]:
    """The hyperparameters of a bank whose members have their own values, one value per gate.

    Member r owns gates r·G ... r·G + G − 1 (G = ``gates_per_member``); the result maps each
    name of ``names`` (default: every key of ``members``) that some member sets (not None) to
    an (R·G,) float64 tensor holding member r's value over its G gates. Pass it to the bank's
    gate (``Variant.build(..., hparams=...)``); the gate takes the names it declares.

    Raises:
        ValueError: a member lacks a value another member sets, or a value is not a number.

    Examples:
        >>> from dselectk import DSelectK
        >>> members = [{"lr": 0.01, "gamma": 1.0}, {"lr": 0.1, "gamma": 2.0}]
        >>> hp = per_gate_hparams(members, gates_per_member=3)  # 2 members of 3 gates
        >>> sorted(hp), hp["gamma"].tolist()
        (['gamma', 'lr'], [1.0, 1.0, 1.0, 2.0, 2.0, 2.0])
        >>> gates = DSelectK(4, k=2, num_gates=6, gamma=hp["gamma"])  # member r's γ, its gates
    """
    if gates_per_member < 1:
        raise ValueError(f"gates_per_member must be >= 1, got {gates_per_member}")
    keys = list(dict.fromkeys(k for m in members for k in m)) if names is None else list(names)
    out: dict[str, Tensor] = {}
    for key in keys:
        values: list[Any] = [m.get(key) for m in members]
        if all(v is None for v in values):
            continue
        missing = [r for r, v in enumerate(values) if v is None]
        if missing:
            raise ValueError(f"per_gate_hparams: member {missing[0]} has no value for {key!r}")
        try:
            t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        except (TypeError, ValueError):
            raise ValueError(f"per_gate_hparams: {key!r} must hold numbers, got {values}") from None
        out[key] = t.repeat_interleave(gates_per_member)
    return out


def bank_loss(model: nn.Module, batch: TaskData) -> tuple[Tensor, None]:
    """The training loss of a :class:`~dselectk.models.MoEBank`: :meth:`MoEBank.loss` of the
    batch (``batch.ys[0]``: the (B, T) targets), the members' losses summed.

    Examples:
        >>> from dselectk import DSelectK, MoEBank, TaskData
        >>> from dselectk.layers import StackedMLP
        >>> bank = MoEBank(StackedMLP(3 * 4, 10, [4]), DSelectK(4, k=2, num_gates=3 * 2), members=3)
        >>> batch = TaskData(torch.randn(8, 10), [torch.randn(8, 2)])  # ys[0]: (B, T)
        >>> loss, output = bank_loss(bank, batch)
        >>> loss.dim(), output
        (0, None)
    """
    if not isinstance(model, MoEBank):
        raise TypeError(f"bank_loss needs a MoEBank, got {type(model).__name__}")
    return model.loss(batch.x, batch.ys[0]), None


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{what}: expected a finite number, got {value!r}")
    return float(value)


def train_bank(
    bank: nn.Module,
    data: TaskData,
    hparams: Mapping[str, Any],
    *,
    batch_size: int,
    shuffle_seed: int,
    member_hparams: Sequence[Mapping[str, Any]] | None = None,
    variant: Variant | None = None,
    gates: Gate | None = None,
    loss_fn: BatchLossFn | None = None,
    search_loss: Callable[[], Tensor] | None = None,
    callbacks: Sequence[Callback | Callable[[nn.Module, History], None]] = (),
    progress: bool = False,
    desc: str = "",
    position: int | None = None,
) -> History:
    """Train the R members of ``bank`` side by side, each with its own hyperparameters.

    Every step draws one mini-batch (one shuffle, ``shuffle_seed``; the global RNG is not
    seeded: the members were initialised by their own seeds) and takes one optimizer step on
    the sum of the members' losses. A member whose loss diverges ends with non-finite
    parameters while the others train on (:meth:`TrainConfig.for_members`).

    Hyperparameters come in two forms:

    * shared, ``hparams`` only: one learning rate (``torch.optim.Adam``), and the variant's
      ramps start at the shared value (:meth:`Variant.schedulers`);
    * per member, ``member_hparams[r]`` updating ``hparams`` for member r: one learning rate
      each (:class:`~dselectk.optim.RowwiseAdam`), and each ramp starts at the member's own
      value (:meth:`Variant.member_schedulers`; a geometric annealing spans the member's own
      ``epochs``). The run lasts the largest ``epochs``: a member with fewer keeps training to
      the end, and a study evaluates it at its own epoch count (a ``callbacks`` entry).
      The bank's gates were built with the members' values (:func:`per_gate_hparams`).

    ``lr`` and ``epochs`` are required (shared or in every member).

    The swap search of ``variant.search`` (if any) runs on ``gates`` after the ``callbacks`` of
    each step, each gate scored by its member's loss: ``search_loss()`` (a (R·G,) loss per gate,
    see :func:`~dselectk.search.swap_search`), by default, for a
    :class:`~dselectk.models.MoEBank`, each task's MSE on a probe of ``data``
    (:meth:`SearchPlan.bank_callback`, drawn with ``shuffle_seed``).

    Args:
        bank: R members laid out member-major (e.g. from :func:`build_bank`).
        data: the training inputs and targets (for a MoEBank: ``x`` (N, in), ``ys[0]``
            (N, T)).
        hparams: the shared hyperparameters (``lr``, ``epochs``, the gate's).
        batch_size: examples per step.
        shuffle_seed: seed of the mini-batch order and of the search's probe.
        member_hparams: one mapping per member (None: all share ``hparams``).
        variant: its ramps and swap search run on ``gates`` (None: neither).
        gates: the bank's gates, R·G of them, member r's G consecutive (default
            ``bank.gates``).
        loss_fn: ``(bank, batch) -> (loss, output)``, the summed loss of all members (default,
            for a MoEBank: :func:`bank_loss`).
        search_loss: the per-gate loss of the search (needed for a bank that is not a MoEBank).
        callbacks: run after every step (before the search) and epoch, as in
            :func:`~dselectk.training.train`.
        progress, desc, position: the progress bar (one tick per epoch).

    Returns:
        The :class:`~dselectk.training.History` of the run.

    Raises:
        ValueError: a missing or invalid ``lr``/``epochs``, a ``member_hparams`` whose length is
            not the bank's member count, or a search without a ``search_loss`` on a bank that
            is not a MoEBank.

    Examples:
        Three members of 2 tasks and 4 experts, each with its own learning rate:

        >>> from dselectk import DSelectK, MoEBank, TaskData
        >>> from dselectk.layers import StackedMLP
        >>> bank = MoEBank(StackedMLP(3 * 4, 10, [4]), DSelectK(4, k=2, num_gates=3 * 2), members=3)
        >>> x, y = torch.randn(64, 10), torch.randn(64, 2)  # y: (N, T)
        >>> members = [{"lr": 0.01}, {"lr": 0.03}, {"lr": 0.1}]
        >>> data = TaskData(x, [y])
        >>> hist = train_bank(bank, data, {"epochs": 1}, member_hparams=members, batch_size=32,
        ...                   shuffle_seed=0)
        >>> hist.steps, tuple(bank.mse(x, y, bank.inference_weights()).shape)  # (R,) MSEs
        (2, (3,))
    """
    members = None if member_hparams is None else [{**hparams, **m} for m in member_hparams]
    if members is not None:
        if not members:
            raise ValueError("member_hparams must hold one mapping per member, got none")
        count = getattr(bank, "members", None)
        if isinstance(count, int) and count != len(members):
            raise ValueError(
                f"member_hparams has {len(members)} entries, the bank has {count} members"
            )
        if variant is not None:
            for r, m in enumerate(member_hparams or []):
                variant.check_hparams(m, f"member_hparams[{r}]")
    every = members if members is not None else [dict(hparams)]
    for r, m in enumerate(every):
        where = "hparams" if members is None else f"member_hparams[{r}]"
        for key in ("lr", "epochs"):
            if m.get(key) is None:
                raise ValueError(f"{where}: no {key!r} (give it in hparams or every member)")
        lr = _number(m["lr"], f"{where}.lr")
        epochs = _number(m["epochs"], f"{where}.epochs")
        if lr <= 0 or epochs < 1 or epochs != int(epochs):
            raise ValueError(f"{where}: lr must be > 0 and epochs an integer >= 1, got {m}")
    lrs = [float(m["lr"]) for m in every]
    epochs = max(int(m["epochs"]) for m in every)
    config = TrainConfig.for_members(
        lr=max(lrs),
        batch_size=batch_size,
        epochs=epochs,
        shuffle_seed=shuffle_seed,
        progress=progress,
        desc=desc,
        position=position,
    )
    steps_per_epoch = math.ceil(data.x.shape[0] / batch_size)
    steps = epochs * steps_per_epoch
    trainable = [p for p in bank.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer
    if members is None:
        opt = torch.optim.Adam(trainable, lr=lrs[0], foreach=True)
    else:
        opt = RowwiseAdam(trainable, lr=torch.tensor(lrs, dtype=torch.float64))
    plan = None if variant is None else variant.search
    if gates is None and variant is not None and (variant.schedules or plan is not None):
        gates = getattr(bank, "gates", None)
        if not isinstance(gates, Gate):
            raise ValueError("train_bank: pass gates= (the bank has no gate bank .gates)")
    schedulers: list[Any] = []
    if variant is not None and variant.schedules:
        assert gates is not None
        if members is None:
            schedulers = variant.schedulers(gates, hparams, max(1, steps))
        else:
            if gates.num_gates is None or gates.num_gates % len(members):
                raise ValueError(
                    f"gates: {gates.num_gates} gates is not a multiple of {len(members)} members"
                )
            per = gates.num_gates // len(members)
            schedulers = variant.member_schedulers(gates, members, per, steps_per_epoch)
    cbs = list(callbacks)
    if plan is not None:
        assert gates is not None
        if search_loss is not None:
            cbs.append(plan.callback(gates, search_loss, steps))
        elif isinstance(bank, MoEBank):
            cbs.append(plan.bank_callback(bank, data.x, data.ys[0], steps, shuffle_seed))
        else:
            kind = type(bank).__name__
            raise ValueError(f"train_bank: a search on a {kind} needs search_loss")
    if loss_fn is None:
        if not isinstance(bank, MoEBank):
            raise ValueError(f"train_bank: pass loss_fn for a {type(bank).__name__}")
        loss_fn = bank_loss
    return train(
        bank,
        data,
        None,
        config,
        schedulers=schedulers,
        optimizer=opt,
        callbacks=cbs,
        loss_fn=loss_fn,
    )
