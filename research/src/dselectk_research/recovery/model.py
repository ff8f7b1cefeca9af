"""The expert-recovery study's variants, vectorized model, and their training (the data is
:mod:`dselectk_research.data.recovery`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dselectk.gates.base import Gate
from dselectk.members import build_bank, train_bank
from dselectk.search import logistic_refit_bce
from dselectk.telemetry import RoutingTelemetry
from dselectk.training import TaskData
from dselectk.variants import SearchPlan, Variant
from dselectk_research.catalog import select
from dselectk_research.data.recovery import FEATURES, UNITS, RecoveryData, expert_outputs
from dselectk_research.executors import progress_position
from dselectk_research.metrics import recovered_experts
from dselectk_research.monitor import GateTrajectory

EXPERIMENT = "recovery"
#: the paper's experts (the default of --experts; --true-experts and --k default to NUM_TRUE)
NUM_EXPERTS = 16
BATCH_SIZE = 256
LRS = [1e-1, 1e-2, 1e-3, 1e-4, 1e-5]
#: hyperparameters under the tuned file's (a variant takes those its gate declares)
BASE_HPARAMS: dict[str, Any] = {"epochs": 50, "gamma": 10.0, "entropy_reg": 0.1}
# The variants kept after the collapse study (research/notes/collapse.md; the retired remedies are
# at commit a78ed56), from :mod:`dselectk_research.catalog`. The swap search
# (dselectk.search; ours) scores each move by every repetition's loss on a probe of the training
# set after refitting the head (refit).
VARIANTS = select(
    "dselect_k",
    "dselect_k_search",
    "topk",
    "topk_search",
    "comet",
    labels={"dselect_k_search": "DSelect-k (paper) + swap local search (ours)"},
)


def _bce(logits: Tensor, y: Tensor) -> Tensor:
    """(R,) mean BCE of each repetition's logits (R, B)."""
    bce = F.binary_cross_entropy_with_logits(logits, y.expand_as(logits), reduction="none")
    return bce.mean(-1)


class RecoveryMoE(nn.Module):
    """R independent recovery models (``experts`` experts, a gate of the variant choosing
    ``k``, default the true count) as one vectorized model: each draws its copy positions of
    the true experts and its random experts, then the gate bank and the heads are built.
    :meth:`from_seeds` builds repetition r as a model of one member built under
    ``torch.manual_seed(init_seeds[r])`` (:func:`~dselectk.members.build_bank`).
    """

    true_mask: Tensor
    experts: Tensor

    def __init__(
        self,
        variant: Variant,
        hp: Mapping[str, Any],
        data: RecoveryData,
        members: int = 1,
        *,
        experts: int = NUM_EXPERTS,
        k: int | None = None,
    ) -> None:
        super().__init__()
        self.reps = self.members = members
        self.num_true = data.num_true
        self.k = data.num_true if k is None else k
        banks, masks = [], []
        for _ in range(members):
            pos = torch.randperm(experts)[: data.num_true]
            bank = torch.randn(experts, FEATURES, UNITS)
            bank[pos] = data.true_experts
            banks.append(bank)
            masks.append(torch.zeros(experts, dtype=torch.bool).index_fill(0, pos, True))
        self.register_buffer("experts", torch.stack(banks))  # (R, E, 10, 4), frozen
        self.register_buffer("true_mask", torch.stack(masks))  # (R, E)
        self.gates: Gate = variant.build(experts, hparams=hp, k=self.k, num_gates=members)
        head = nn.Linear(UNITS, members)
        self.head_w = nn.Parameter(head.weight.detach().clone())  # (R, 4)
        self.head_b = nn.Parameter(head.bias.detach().clone())  # (R,)

    @classmethod
    def from_seeds(
        cls,
        variant: Variant,
        hp: Mapping[str, Any],
        data: RecoveryData,
        init_seeds: Sequence[int],
        *,
        experts: int = NUM_EXPERTS,
        k: int | None = None,
    ) -> RecoveryMoE:
        """One repetition per seed: repetition r is the model of one member built under
        ``torch.manual_seed(init_seeds[r])``."""

        def make(r: int | None) -> RecoveryMoE:
            n = len(init_seeds) if r is None else 1
            return cls(variant, hp, data, n, experts=experts, k=k)

        return build_bank(make, init_seeds, buffers=("experts", "true_mask"))

    def features(self, x: Tensor) -> Tensor:
        """Frozen expert outputs (B, R, E, 4), examples first (precomputed once)."""
        return expert_outputs(x, self.experts).permute(2, 0, 1, 3).contiguous()

    def forward(self, feats: Tensor, head: bool = True) -> tuple[Tensor, Tensor]:
        """Logits (R, B) from precomputed expert outputs (head False: the gated mixture
        (R, B, 4)), and the gates' summed aux loss."""
        out = self.gates()
        h = torch.einsum("rn,brnu->rbu", out.weights, feats)
        if not head:
            return h, out.aux_loss
        return torch.einsum("rbu,ru->rb", h, self.head_w) + self.head_b.unsqueeze(-1), out.aux_loss


@torch.no_grad()
def _evaluate(model: RecoveryMoE, feats: Tensor, y: Tensor) -> list[dict[str, float]]:
    logits, _ = model(feats)
    w = model.gates.expert_weights()
    rec = recovered_experts(w, model.true_mask, model.k)
    cols = {
        "val_loss": _bce(logits, y),
        "val_accuracy": ((logits > 0).float() == y).float().mean(-1),
        "recovered": rec,
        "all_recovered": rec == model.num_true,
        "experts_selected": (w > 0).sum(-1),
    }
    if model.gates.binarizes:  # DSelect-k: S(Z) binary; COMET: each tree reaches one leaf
        cols["binary"] = model.gates.is_binary()
    return [{name: float(v[r]) for name, v in cols.items()} for r in range(model.reps)]


def _loss(model: nn.Module, batch: TaskData) -> tuple[Tensor, None]:
    """Σ_r mean BCE of repetition r + the gates' auxiliary losses."""
    logits, aux = model(batch.x)
    return _bce(logits, batch.ys[0]).sum() + aux, None


def _member_loss(model: RecoveryMoE, data: RecoveryData, plan: SearchPlan, seed: int) -> Any:
    """The search's score: each repetition's BCE on a fixed probe of the training set, after
    refitting a copy of the head when ``plan.refit`` (scored with the old head, a move towards
    the true experts can look worse than the wrong selection the head was fitted to)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(data.y_train.shape[0], generator=g)[: plan.probe]
    feats, y = model.features(data.x_train[idx]), data.y_train[idx]

    def member_loss() -> Tensor:
        if not plan.refit:
            return _bce(model(feats)[0], y)
        h = model(feats, head=False)[0]  # (R, B, 4)
        w = torch.cat([model.head_w, model.head_b.unsqueeze(-1)], -1).detach()  # (R, 5)
        return logistic_refit_bce(torch.cat([h, torch.ones_like(h[..., :1])], -1), y, w)

    return member_loss


def train_reps(
    variant: Variant,
    hparams: Mapping[str, Any],
    data: RecoveryData,
    init_seeds: Sequence[int],
    *,
    shuffle_seed: int,
    experts: int = NUM_EXPERTS,
    k: int | None = None,
    lrs: Sequence[float] | None = None,
    record_every: int = 0,
    record_reps: Sequence[int] = (0,),
    progress: bool = False,
    desc: str = "",
    telemetry_dir: Path | None = None,
) -> tuple[list[dict[str, float]], dict[int, dict[str, Any]]]:
    """Train R repetitions (one per init seed; one learning rate each, ``lrs``, default
    ``hparams["lr"]``) together on the same mini-batches; return their final metrics and the
    gate-weight trajectories of ``record_reps`` ({rep: {"steps", "weights", "true"}}, every
    ``record_every`` steps; 0: none). ``telemetry_dir``: routing telemetry, gates/task<r> = rep r.
    """
    model = RecoveryMoE.from_seeds(variant, hparams, data, init_seeds, experts=experts, k=k)
    rates = [float(v) for v in lrs] if lrs else [float(hparams["lr"])] * model.reps
    trajectory = GateTrajectory(model.gates, record_reps if record_every else (), record_every or 1)
    for r, tr in trajectory.trajectories.items():  # and the positions of the true experts
        tr["true"] = model.true_mask[r].nonzero().flatten().tolist()
    cbs: list[Any] = [trajectory]
    if telemetry_dir is not None:
        cbs.append(RoutingTelemetry(telemetry_dir, every=record_every or 10))
    plan = variant.search
    train_bank(
        model,
        TaskData(model.features(data.x_train), [data.y_train]),
        hparams,
        member_hparams=[{"lr": v} for v in rates],
        variant=variant,
        loss_fn=_loss,
        search_loss=None if plan is None else _member_loss(model, data, plan, shuffle_seed),
        batch_size=BATCH_SIZE,
        shuffle_seed=shuffle_seed,
        callbacks=cbs,
        progress=progress,
        desc=desc,
        position=progress_position(),
    )
    return _evaluate(model, model.features(data.x_val), data.y_val), trajectory.trajectories
