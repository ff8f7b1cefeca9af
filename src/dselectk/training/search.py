"""Swap local search for sparse static gates: discrete moves that first-order training cannot make.

Once DSelect-k's S(Z) is binary its gradient is exactly zero, so a selector that binarized on
the wrong expert (or on the same expert as another selector, the "collapse" of
``research/notes/collapse.md``) can never move again by gradient descent. Top-k has the same blind
spot
for experts outside its top k (they receive no gradient). The COMET paper (Ibrahim et al.,
KDD 2023) makes this point and answers it with a learned permutation of the experts; this
module answers it with the plain combinatorial move instead: **swap** one selected expert for
another and keep the swap when the data loss falls.

:func:`swap_search` runs a best-improvement coordinate search over the selectors of every gate
of a bank at once: for selector (or top-k slot) i it tries every expert, scores each with the
caller's per-gate loss, and moves the gates for which some expert beats the current choice.
:class:`SwapSearch` is the :class:`~dselectk.training.Callback` that runs it at chosen steps of
:func:`~dselectk.training.train`.

The search is written against the gate contract only (:attr:`~dselectk.gates.base.Gate.searchable`,
:meth:`~dselectk.gates.base.Gate.selection`, :meth:`~dselectk.gates.base.Gate.selection_is_final`,
:meth:`~dselectk.gates.base.Gate.set_selection`); each gate decides what a move writes. A
DSelect-k move writes selector i's Z row to ``±scale·γ`` per bit (the code of the new expert,
exactly binary, saturated, so leftover optimizer momentum cannot pull it back inside); α is not
touched, so the selector keeps its share. A Top-k move exchanges two experts' logits (the
selected set changes by one expert, the weights keep their values). Candidates already held by
another selector whose selection is final are skipped (no move creates a collision).
Per-example gates are not supported (their selection is a function of the input, not a
parameter one can move).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dselectk._validate import check_flag
from dselectk.gates.base import Gate
from dselectk.gates.hyperparameter import check_positive_int
from dselectk.models.bank import MoEBank
from dselectk.models.moe import MoE, MultiGateMoE
from dselectk.training.callbacks import Callback
from dselectk.training.state import History
from dselectk.training.tasks import LossFn, TaskData, task_outputs

__all__ = [
    "RefitStats",
    "SearchPlan",
    "SearchResult",
    "SwapSearch",
    "default_plan",
    "logistic_refit_bce",
    "model_searches",
    "selector_refit_mse",
    "swap_search",
]

MemberLoss = Callable[[], Tensor]


@dataclass
class SearchResult:
    """What one :func:`swap_search` did.

    Examples:
        >>> from dselectk import DSelectK
        >>> gate = DSelectK(8, k=2)
        >>> gate.set_selection(torch.tensor([0, 1]))
        >>> target = torch.tensor([0.0, 0, 0, 0.5, 0, 0.5, 0, 0])  # experts 3 and 5, half each
        >>> result = swap_search(gate, lambda: (gate().weights - target).square().sum())
        >>> result.moves.tolist(), result.sweeps, result.evaluations  # (G,) moves, G = 1
        ([2], 2, 33)
        >>> bool(result.loss_after < result.loss_before)
        True
    """

    moves: Tensor
    """(G,) accepted moves per gate."""
    loss_before: Tensor
    """(G,) per-gate loss before the search."""
    loss_after: Tensor
    """(G,) per-gate loss after it (never above ``loss_before``, except with ``binarize``, which
    may trade loss for binarity)."""
    evaluations: int = 0
    """Calls of the loss function."""
    sweeps: int = 0
    """Sweeps run (a sweep that moves nothing ends the search)."""


def _check_gate(gate: Gate) -> None:
    if not isinstance(gate, Gate) or not gate.searchable:
        raise TypeError(
            "gate: swap_search supports the searchable gates (Gate.searchable: DSelectK and "
            f"TopKGate), got {type(gate).__name__}"
        )
    if not gate.static:
        raise ValueError(
            "gate: swap_search needs a static gate (in_features=None); a per-example gate's "
            "selection is a function of the input, not a parameter"
        )


def _check_binarize(gate: Gate, what: str) -> None:
    if not gate.binarizes:
        raise ValueError(
            f"{what}: {type(gate).__name__}'s selection is final by construction (only gates "
            "whose selection becomes binary in training, such as DSelectK, have non-binary "
            "selectors)"
        )


def _check_search_args(sweeps: int, tol: float, scale: float) -> None:
    """``sweeps`` an int >= 1, ``tol`` finite >= 0, ``scale`` finite >= 0.5 (errors name them)."""
    check_positive_int("sweeps", sweeps)
    for name, value in (("tol", tol), ("scale", scale)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a finite number, got {type(value).__name__}")
    if not (math.isfinite(tol) and tol >= 0):
        raise ValueError(f"tol must be a finite number >= 0, got {tol}")
    if not (math.isfinite(scale) and scale >= 0.5):
        raise ValueError(
            f"scale must be a finite number >= 0.5 (a move must be binary and finite), got {scale}"
        )


def _losses(member_loss: MemberLoss, groups: int) -> Tensor:
    out = torch.as_tensor(member_loss()).detach().float().reshape(-1)
    if out.numel() != groups:
        raise ValueError(
            f"member_loss must return one loss per gate of the bank ({groups}), "
            f"got shape {tuple(out.shape)}"
        )
    if not torch.isfinite(out).all():
        raise NonFiniteSearchLoss("member_loss returned a non-finite loss")
    return out.cpu()


class NonFiniteSearchLoss(ValueError):
    """A search's ``member_loss`` returned NaN/inf (a diverged model cannot be scored)."""


def _threshold(best: Tensor, tol: float) -> Tensor:
    """A candidate must score below this to replace ``best`` (inf stays inf)."""
    return torch.where(torch.isfinite(best), best - tol * best.abs(), best)


@torch.no_grad()
def swap_search(
    gate: Gate,
    member_loss: MemberLoss,
    *,
    sweeps: int = 2,
    tol: float = 1e-4,
    scale: float = 1.0,
    binarize: bool = False,
) -> SearchResult:
    """Best-improvement swap search over a static searchable gate (bank).

    Args:
        gate: a static gate with :attr:`~dselectk.gates.base.Gate.searchable` (DSelect-k,
            Top-k), one gate or a bank of G gates; its selection is changed in place.
        member_loss: called with no arguments under ``torch.no_grad()``; returns the data loss
            of each gate's model at the gate's current parameters, shape (G,) (or a scalar for
            a single gate). Use a fixed batch so that scores are comparable.
        sweeps: at most this many passes over the selectors (a pass with no move stops).
        tol: a move is kept when it lowers a gate's loss by more than ``tol`` × |loss| (a
            finite number >= 0).
        scale: DSelect-k moves write ``±scale·γ`` per bit (finite; binary needs ≥ 0.5).
        binarize: gates whose selection becomes binary in training (DSelect-k): in the first
            sweep a selector whose selection is not final, or is final on an expert another
            final selector holds, must move to its best free expert even when that raises the
            loss, so that the selection is final afterwards with k distinct experts.
            ``loss_after`` may then exceed ``loss_before``.

    Returns:
        A :class:`SearchResult`.

    Examples:
        A DSelect-k gate set on experts 0 and 1 whose loss wants experts 3 and 5:

        >>> from dselectk import DSelectK
        >>> gate = DSelectK(8, k=2)
        >>> gate.set_selection(torch.tensor([0, 1]))
        >>> target = torch.tensor([0.0, 0, 0, 0.5, 0, 0.5, 0, 0])
        >>> result = swap_search(gate, lambda: (gate().weights - target).square().sum())
        >>> sorted(gate.selection().tolist()), round(float(result.loss_after), 4)
        ([3, 5], 0.0)
    """
    _check_gate(gate)
    if not callable(member_loss):
        raise TypeError(f"member_loss must be callable, got {type(member_loss).__name__}")
    _check_search_args(sweeps, tol, scale)
    groups = gate.num_gates or 1
    before = _losses(member_loss, groups)
    best = before.clone()
    moves = torch.zeros(groups, dtype=torch.long)
    evals = 1
    if binarize:
        _check_binarize(gate, "binarize")
    done = 0
    for _ in range(sweeps):
        done += 1
        moved, n, best = _sweep(gate, member_loss, best, tol, scale, binarize and done == 1)
        evals += n
        moves += moved
        if not bool(moved.any()):
            break
    return SearchResult(moves, before, best, evals, done)


def _sweep(
    gate: Gate,
    member_loss: MemberLoss,
    best: Tensor,
    tol: float,
    scale: float,
    binarize: bool,
) -> tuple[Tensor, int, Tensor]:
    """One pass over the selectors: each tries every expert, the gates that improve move."""
    logits = gate.logits
    assert logits is not None  # a static gate
    k, n = int(gate.k), gate.num_experts
    groups = best.shape[0]
    shape = (k,) if gate.num_gates is None else (groups, k)  # that of gate.selection()
    moved = torch.zeros(groups, dtype=torch.long)
    evals = 0
    for i in range(k):
        keep = logits.detach().clone()
        held, final, code = _held(gate, skip=i)  # held by the other final selectors
        if binarize:  # a fractional or colliding selector must move: its loss does not count
            kept_best = best
            rows = torch.arange(groups, device=code.device)
            stays = final[:, i] & ~held[rows, code[:, i].clamp(max=n - 1)]
            stays &= code[:, i] < n
            best = torch.where(stays.cpu(), best, torch.full_like(best, float("inf")))
        choice = torch.full((groups,), -1, dtype=torch.long)
        trial = torch.full((groups, k), -1, dtype=torch.long, device=code.device)
        for c in range(n):
            free = ~held[:, c]
            trial[:, i] = torch.where(free, c, -1)
            logits.copy_(keep)
            gate.set_selection(trial.view(shape), scale=scale)
            loss = _losses(member_loss, groups)
            evals += 1
            better = (loss < _threshold(best, tol)) & free.cpu()
            best = torch.where(better, loss, best)
            choice = torch.where(better, torch.tensor(c), choice)
        logits.copy_(keep)
        trial[:, i] = choice.to(trial.device)
        gate.set_selection(trial.view(shape), scale=scale)
        if binarize:
            best = torch.where(choice >= 0, best, kept_best)
        moved += (choice >= 0).long()
    return moved, evals, best


def _held(gate: Gate, skip: int) -> tuple[Tensor, Tensor, Tensor]:
    """(G, N) bool: expert c is the selection of some final selector other than ``skip``;
    (G, K) bool: selector j's selection is final; (G, K) the selection of each selector."""
    k = int(gate.k)
    code = gate.selection().reshape(-1, k)  # (G, K)
    final = gate.selection_is_final().reshape(-1, k)  # (G, K)
    held = torch.zeros(code.shape[0], gate.num_experts, dtype=torch.bool, device=code.device)
    for j in range(k):
        if j == skip:
            continue
        ok = final[:, j] & (code[:, j] < gate.num_experts)
        held[ok, code[ok, j]] = True
    return held, final, code


@dataclass(frozen=True)
class RefitStats:
    """Second moments of R models' expert outputs and task targets on a probe batch: all that
    :func:`selector_refit_mse` needs (float64). The experts do not change during a search, so
    one set serves every candidate a search scores: a candidate then costs O(T·K·E²) per model
    instead of a pass over the probe.

    Examples:
        >>> stats = RefitStats.of(torch.randn(2, 4, 16), torch.randn(3, 16))  # (R, E, B), (T, B)
        >>> tuple(stats.gram.shape), tuple(stats.cross.shape), tuple(stats.target.shape)
        ((2, 4, 4), (2, 4, 3), (1, 3))
    """

    gram: Tensor
    """(R, E, E) ``f fᵀ / B``."""
    cross: Tensor
    """(R, E, T) ``f yᵀ / B``."""
    target: Tensor
    """(R or 1, T) ``|y_t|² / B``."""

    @classmethod
    @torch.no_grad()
    def of(cls, expert_out: Tensor, y: Tensor) -> RefitStats:
        """From (R, E, B) (or (E, B)) expert outputs and (T, B) (or (R, T, B)) targets."""
        f = (expert_out if expert_out.dim() == 3 else expert_out.unsqueeze(0)).double()
        yt = (y if y.dim() == 3 else y.unsqueeze(0)).double()
        if yt.shape[-1] != f.shape[-1] or yt.shape[0] not in (1, f.shape[0]):
            raise ValueError(
                f"expert_out {tuple(expert_out.shape)} and y {tuple(y.shape)} must share the "
                "batch (last dim) and R"
            )
        b = f.shape[-1]
        cross = torch.einsum("reb,rtb->ret", f, yt.expand(f.shape[0], -1, -1)) / b
        return cls(f @ f.transpose(-1, -2) / b, cross, yt.square().sum(-1) / b)


@torch.no_grad()
def selector_refit_mse(gate: Gate, stats: RefitStats, ridge: float = 1e-4) -> Tensor:
    """Per-gate score of a selection that does not depend on the selector shares σ(α).

    For models whose task output is linear in the gate's mixture, ``ŷ_t = Σ_i σ(α_t)_i h_ti``
    with selector outputs ``h_ti(x) = Σ_e r(S(z_ti))_e f_e(x)``: the mean squared error of the
    least-squares fit ``y_t ≈ Σ_i c_i h_ti`` (c free; a ridge of ``ridge`` × the mean diagonal
    of the Gram matrix keeps collided selectors finite), computed from the probe's second
    moments (:class:`RefitStats`). A move changes the expert a selector reads while σ(α) was
    fitted to the old one; scored with the old shares, a right move can look worse. Use it as
    :func:`swap_search`'s ``member_loss``; nothing is changed.

    Args:
        gate: a static searchable gate (DSelect-k, Top-k) bank of G = R·T gates (model r owns
            gates ``r·T … (r+1)·T − 1``); its selector outputs are given by
            :meth:`~dselectk.gates.base.Gate.selector_weights` (Top-k: its k selected experts'
            outputs).
        stats: :meth:`RefitStats.of` the R models' expert outputs and the T tasks' targets.

    Returns:
        (G,) the refitted MSE of each gate (float32).

    Examples:
        A target that is a mix of the two selected experts refits exactly:

        >>> from dselectk import DSelectK
        >>> f = torch.randn(4, 64)  # (E, B) outputs of 4 experts
        >>> gate = DSelectK(4, k=2)
        >>> gate.set_selection(torch.tensor([1, 2]))
        >>> round(float(selector_refit_mse(gate, RefitStats.of(f, (2 * f[1] - f[2])[None]))), 4)
        0.0
        >>> bool(selector_refit_mse(gate, RefitStats.of(f, f[3:])) > 0.1)  # expert 3 not selected
        True
    """
    _check_gate(gate)
    r, e, t = stats.cross.shape
    if e != gate.num_experts:
        raise ValueError(f"stats must have {gate.num_experts} experts, got {e}")
    g = gate.num_gates or 1
    if r * t != g:
        raise ValueError(f"stats hold R={r} models × T={t} tasks, the gate bank has {g} gates")
    k = int(gate.k)
    sel = gate.selector_weights()  # (G, K, E): each selector's expert weights
    sel = sel.reshape(r, t, k, e).double()
    gram = sel @ stats.gram.unsqueeze(1) @ sel.transpose(-1, -2)  # (R, T, K, K)
    b = torch.einsum("rtke,ret->rtk", sel, stats.cross)  # (R, T, K)
    scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12)  # (R, T)
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    c = torch.linalg.solve(gram + ridge * scale[..., None, None] * eye, b.unsqueeze(-1))
    fit = (c.transpose(-1, -2) @ gram @ c).squeeze(-1).squeeze(-1) - 2 * (c.squeeze(-1) * b).sum(-1)
    return (stats.target + fit).clamp_min(0.0).flatten().float()


def logistic_refit_bce(h: Tensor, y: Tensor, w: Tensor, iters: int = 8, l2: float = 1e-3) -> Tensor:
    """(R,) mean BCE of logistic regressions of y (B,) on h (R, B, d), each refitted from w
    (R, d) by ``iters`` Newton steps on BCE + l2·|w|² (a tiny ridge keeps separable data
    finite): the classification counterpart of :func:`selector_refit_mse`, for a search's
    ``member_loss`` when a logistic head was fitted to the old selection.

    Examples:
        >>> h = torch.randn(2, 64, 3)  # (R, B, d) features of 2 models
        >>> y = (h[0, :, 0] > 0).float()  # (B,) separable by model 0's first feature
        >>> bce = logistic_refit_bce(h, y, torch.zeros(2, 3))  # refitted from w = 0
        >>> tuple(bce.shape), bool(bce[0] < bce[1] < math.log(2))
        ((2,), True)
    """
    eye = torch.eye(h.shape[-1], dtype=h.dtype)
    for _ in range(iters):
        p = torch.sigmoid(torch.einsum("rbd,rd->rb", h, w))
        grad = torch.einsum("rbd,rb->rd", h, p - y) / h.shape[1] + 2 * l2 * w
        hess = torch.einsum("rbd,rb,rbe->rde", h, p * (1 - p), h) / h.shape[1] + 2 * l2 * eye
        w = w - torch.linalg.solve(hess, grad.unsqueeze(-1)).squeeze(-1)
    logits = torch.einsum("rbd,rd->rb", h, w)
    bce = F.binary_cross_entropy_with_logits(logits, y.expand_as(logits), reduction="none")
    return bce.mean(-1)


@dataclass
class SwapSearch(Callback):
    """Run :func:`swap_search` on ``gate`` after the training steps ``at``.

    Args:
        gate: the static gate (bank) to search.
        member_loss: the per-gate loss at the current parameters, shape (G,) (see
            :func:`swap_search`); typically the model's data loss on a fixed training batch.
        at: steps (1-based, as ``History.steps``) after which to search.
        sweeps, tol, scale: see :func:`swap_search`.
        binarize_at: steps after which to search with ``binarize=True`` (DSelect-k: S(Z) is
            binary with k distinct experts afterwards); may overlap ``at``.
        skip_nonfinite: a search whose losses are NaN/inf (a diverged model trained on with
            ``TrainConfig(nonfinite="warn")``, which warns about the divergence itself) is
            skipped, its step recorded in :attr:`skipped`, instead of raising (what
            ``TrainConfig.search`` uses).

    Examples:
        >>> from dselectk import DSelectK, MoE, TaskData, TrainConfig, train
        >>> from dselectk.layers import StackedMLP
        >>> x = torch.randn(64, 4)
        >>> model = MoE(StackedMLP(4, 4, [1]), DSelectK(4, k=2))
        >>> data = TaskData(x, [x[:, :1]])
        >>> search = SwapSearch(model.gate, lambda: F.mse_loss(model(x).output, data.ys[0]), at=[1])
        >>> config = TrainConfig(epochs=1, progress=False)
        >>> hist = train(model, data, "mse", config, callbacks=[search])
        >>> len(search.results), tuple(search.total_moves.shape)  # one search after step 1
        (1, (1,))
    """

    gate: Gate
    member_loss: MemberLoss
    at: Sequence[int]
    sweeps: int = 2
    tol: float = 1e-4
    scale: float = 1.0
    binarize_at: Sequence[int] = ()
    results: list[SearchResult] = field(default_factory=list)
    skip_nonfinite: bool = False
    skipped: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_gate(self.gate)
        if not callable(self.member_loss):
            raise TypeError(f"member_loss must be callable, got {type(self.member_loss).__name__}")
        _check_search_args(self.sweeps, self.tol, self.scale)
        check_flag("skip_nonfinite", self.skip_nonfinite)
        for name, steps in (("at", self.at), ("binarize_at", self.binarize_at)):
            if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
                raise TypeError(f"{name} must be a sequence of steps (ints >= 1), got {steps!r}")
            for s in steps:
                if isinstance(s, bool) or not hasattr(type(s), "__index__"):
                    raise TypeError(f"{name}: steps must be ints >= 1, got {s!r}")
                if operator.index(s) < 1:
                    raise ValueError(f"{name}: steps must be >= 1, got {sorted(steps)}")
        self._at = {operator.index(s) for s in self.at}
        self._binarize_at = {operator.index(s) for s in self.binarize_at}
        if not self._at and not self._binarize_at:
            raise ValueError("at/binarize_at: give at least one step to search after")
        if self._binarize_at:
            _check_binarize(self.gate, "binarize_at")

    def on_step(self, model: nn.Module, batch: TaskData, out: Any, history: History) -> None:
        if history.steps in self._at or history.steps in self._binarize_at:
            was = model.training
            model.eval()
            try:
                self.results.append(
                    swap_search(
                        self.gate,
                        self.member_loss,
                        sweeps=self.sweeps,
                        tol=self.tol,
                        scale=self.scale,
                        binarize=history.steps in self._binarize_at,
                    )
                )
            except NonFiniteSearchLoss:
                if not self.skip_nonfinite:
                    raise
                self.skipped.append(history.steps)
            finally:
                model.train(was)

    @classmethod
    def at_fractions(
        cls,
        gate: Gate,
        member_loss: MemberLoss,
        steps_total: int,
        at: Sequence[float],
        binarize: float | None = None,
        **kwargs: Any,
    ) -> SwapSearch:
        """A search scheduled by fractions of a run of ``steps_total`` steps.

        ``at`` (and ``binarize``, if given) are fractions in (0, 1]; each becomes the step
        ``max(1, round(f · steps_total))``. ``kwargs`` are the other fields (``tol``, ...).
        """
        check_positive_int("steps_total", steps_total)
        fractions = [*at, *([] if binarize is None else [binarize])]
        if any(not 0.0 < float(f) <= 1.0 for f in fractions):  # NaN fails too
            raise ValueError(f"at/binarize: fractions must lie in (0, 1], got {fractions}")

        def step(f: float) -> int:
            return max(1, round(float(f) * steps_total))

        final = [] if binarize is None else [step(binarize)]
        return cls(gate, member_loss, at=sorted({step(f) for f in at}), binarize_at=final, **kwargs)

    @classmethod
    def from_plan(
        cls, gate: Gate, member_loss: MemberLoss, steps_total: int, plan: Mapping[str, Any]
    ) -> SwapSearch:
        """:meth:`at_fractions` from a plan mapping: ``at`` (fractions, required), ``binarize``
        (a fraction or None) and ``tol`` (optional); other keys are an error."""
        unknown = set(plan) - {"at", "binarize", "tol"}
        if unknown or "at" not in plan:
            raise ValueError(f"plan needs 'at' and may hold binarize, tol; got {sorted(plan)}")
        return cls.at_fractions(
            gate,
            member_loss,
            steps_total,
            plan["at"],
            plan.get("binarize"),
            tol=float(plan.get("tol", 1e-4)),
        )

    @property
    def total_moves(self) -> Tensor | None:
        """(G,) moves summed over the searches so far (None before the first)."""
        if not self.results:
            return None
        return torch.stack([r.moves for r in self.results]).sum(0)


@dataclass(frozen=True)
class SearchPlan:
    """When the swap local search (:mod:`dselectk.search`) runs during training.

    Attributes:
        at: fractions of the training steps after which the search runs.
        binarize: the fraction after which fractional or colliding selectors are forced onto
            their best free code (DSelect-k); None: never.
        refit: score a move after refitting the read-out of the selection (the study supplies
            the refitted loss); False: with the model as it is.
        probe: examples of the training set the moves are scored on.

    Examples:
        >>> from dselectk import DSelectK, TrainConfig
        >>> plan = SearchPlan(at=(0.25, 0.7), binarize=0.5)
        >>> config = TrainConfig(search=plan)  # what train() runs on a static sparse gate
        >>> gate = DSelectK(8, k=2)
        >>> search = plan.callback(gate, lambda: gate().weights.square().sum(), total_steps=100)
        >>> search.at, search.binarize_at  # steps of a 100-step run
        ([25, 70], [50])
    """

    at: tuple[float, ...]
    binarize: float | None = None
    refit: bool = False
    probe: int = 2048

    def callback(
        self, gate: Gate, member_loss: Callable[[], Tensor], total_steps: int
    ) -> SwapSearch:
        """The :class:`~dselectk.search.SwapSearch` callback of this plan."""
        return SwapSearch.at_fractions(gate, member_loss, total_steps, self.at, self.binarize)

    def bank_callback(
        self, bank: MoEBank, x: Tensor, y: Tensor, total_steps: int, seed: int
    ) -> SwapSearch:
        """The search of a :class:`~dselectk.models.MoEBank`'s gates: each (member, task) gate
        scored by that task's mean squared error on a fixed probe of ``probe`` rows of ``x``
        (N, in) and ``y`` (N, T), drawn with ``seed``; with ``refit``, after refitting the
        selector shares by least squares (:func:`~dselectk.search.selector_refit_mse`)."""
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(x.shape[0], generator=g)[: self.probe]
        xp, yp = x[idx], y[idx].T  # (B, in), (T, B)

        def member_loss() -> Tensor:
            pred, _ = bank(xp)  # (R, T, B)
            return ((pred - yp) ** 2).mean(-1).flatten()

        if self.refit:
            cache: dict[tuple[int, ...], RefitStats] = {}

            def member_loss() -> Tensor:
                # the experts' probe moments, recomputed only after an optimizer step changed them
                key = tuple(p._version for p in bank.experts.parameters())
                if key not in cache:
                    cache.clear()
                    cache[key] = RefitStats.of(bank.expert_outputs(xp), yp)
                return selector_refit_mse(bank.gates, cache[key])

        return self.callback(bank.gates, member_loss, total_steps)

    def identity(self) -> dict[str, Any]:
        """The plan as a run record stores it."""
        out: dict[str, Any] = {"at": list(self.at), "binarize": self.binarize}
        if self.refit:
            out["refit"] = True
        return out


#: The plan ``TrainConfig(search="auto")`` runs on a static gate whose selection becomes binary in
#: training (DSelect-k): search after 25 % of the steps, force a binary selection of k distinct
#: experts at 50 %, search again at 70 % and 85 % (the studies' plan, scored without refitting).
BINARIZING_PLAN = SearchPlan(at=(0.25, 0.7, 0.85), binarize=0.5)
#: The plan ``TrainConfig(search="auto")`` runs on the other searchable static gates (Top-k).
SWAP_PLAN = SearchPlan(at=(0.25, 0.5, 0.7, 0.85))


def default_plan(gate: Gate) -> SearchPlan:
    """The search ``TrainConfig(search="auto")`` runs on ``gate``: :data:`BINARIZING_PLAN` for
    a gate whose selection becomes binary in training (DSelect-k), else :data:`SWAP_PLAN`.

    Examples:
        >>> from dselectk import DSelectK, TopKGate
        >>> default_plan(DSelectK(8, k=2))
        SearchPlan(at=(0.25, 0.7, 0.85), binarize=0.5, refit=False, probe=2048)
        >>> default_plan(TopKGate(8, k=2)).at
        (0.25, 0.5, 0.7, 0.85)
    """
    return BINARIZING_PLAN if gate.binarizes else SWAP_PLAN


class _Searched(NamedTuple):
    gate: Gate
    task: int | None  # the task of a single gate of a MultiGateMoE; None: the gate's loss vector


def _searchable(gate: Any) -> bool:
    return isinstance(gate, Gate) and gate.searchable and gate.static


def _gates_of(model: nn.Module) -> list[_Searched]:
    """The searchable static gates of a library model, each with how its loss is read."""
    if isinstance(model, MoE):
        return [_Searched(model.gate, None)] if _searchable(model.gate) else []
    if isinstance(model, MultiGateMoE):
        if isinstance(model.gates, Gate):
            return [_Searched(model.gates, None)] if _searchable(model.gates) else []
        return [_Searched(g, t) for t, g in enumerate(model.gates) if _searchable(g)]
    if isinstance(model, MoEBank):
        return [_Searched(model.gates, None)] if _searchable(model.gates) else []
    return []


def model_searches(
    model: nn.Module,
    data: TaskData,
    losses: Sequence[LossFn],
    plan: SearchPlan | str | None,
    total_steps: int,
    seed: int = 0,
) -> list[SwapSearch]:
    """The swap searches :func:`~dselectk.training.train` runs for ``TrainConfig.search``.

    For every searchable static gate of ``model`` (a :class:`~dselectk.models.MoE`, a
    :class:`~dselectk.models.MultiGateMoE` with one gate bank or a list of gates, a
    :class:`~dselectk.models.MoEBank`; a ``DistributedDataParallel`` wrapper is looked through):
    one :class:`SwapSearch` scoring each gate by its task's loss (``losses[t]``) on a fixed probe
    of ``plan.probe`` training examples drawn with ``seed``, in eval mode, without refitting.

    Args:
        model: the model being trained.
        data: the training data (the probe is drawn from it).
        losses: one loss function per task.
        plan: ``"auto"`` (:func:`default_plan` of each gate; no search for a model without a
            searchable static gate), a :class:`SearchPlan` (``refit`` is not supported here:
            a tower reads the mixture, so the shares cannot be refitted by least squares), or
            None (no search).
        total_steps: the optimizer steps of the run (the plan's fractions are of these).
        seed: seed of the probe's draw.

    Raises:
        ValueError: ``plan`` is a :class:`SearchPlan` and ``model`` has no searchable static
            gate, or the plan asks for ``refit``.

    Examples:
        >>> from dselectk import DSelectK, MultiGateMoE, TaskData
        >>> from dselectk.layers import StackedMLP, make_towers
        >>> experts, towers = StackedMLP(4, 4, [8]), make_towers(2, 8, [1])
        >>> model = MultiGateMoE(experts, DSelectK(4, k=2, num_gates=2), towers)
        >>> x = torch.randn(64, 4)
        >>> data = TaskData(x, [x[:, :1], x[:, 1:2]])
        >>> searches = model_searches(model, data, [F.mse_loss] * 2, "auto", total_steps=100)
        >>> len(searches), searches[0].at, searches[0].binarize_at  # one for the gate bank
        (1, [25, 70, 85], [50])
    """
    if plan is None:
        return []
    inner = getattr(model, "module", model)
    found = _gates_of(inner)
    if isinstance(plan, SearchPlan):
        if plan.refit:
            raise ValueError(
                "search: refit=True is not supported by train()'s search (the tower reads the "
                "mixture); use SearchPlan.bank_callback or a SwapSearch callback"
            )
        if not found:
            raise ValueError(
                f"search: {type(inner).__name__} has no searchable static gate (DSelectK or "
                "TopKGate with in_features=None in a MoE, MultiGateMoE or MoEBank); pass "
                "search=None"
            )
    elif plan != "auto":
        raise ValueError(f"search must be 'auto', a SearchPlan or None, got {plan!r}")
    if not found:
        return []
    g = torch.Generator().manual_seed(int(seed))
    size = plan.probe if isinstance(plan, SearchPlan) else SWAP_PLAN.probe
    idx = torch.randperm(len(data), generator=g)[:size]
    probe = data.batch(idx)
    fns = list(losses)

    def task_losses() -> Tensor:
        """(T,) of a single-model family; (R·T,) of a bank, member-major (its gates' order)."""
        preds, _, members = task_outputs(inner, inner(probe.x))
        if members is None:
            return torch.stack([fn(p, y).float() for fn, p, y in zip(fns, preds, probe.ys)])
        per = [  # per[t][r]
            [fn(p[:, r : r + 1], y).float() for r in range(members)]
            for fn, p, y in zip(fns, preds, probe.ys)
        ]
        return torch.tensor(per).T.flatten()

    out = []
    for item in found:
        chosen = plan if isinstance(plan, SearchPlan) else default_plan(item.gate)

        def member_loss(task: int | None = item.task) -> Tensor:
            losses_now = task_losses()
            return losses_now if task is None else losses_now[task]

        search = chosen.callback(item.gate, member_loss, total_steps)
        search.skip_nonfinite = True
        out.append(search)
    return out
