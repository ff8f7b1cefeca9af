"""The expert-recovery study's data, its vectorized model, and their training."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dselectk.experiments.metrics import recovered_experts
from dselectk.experiments.runner import progress_position
from dselectk.gates import COMETGate, DSelectK, make_gate
from dselectk.gates.base import Gate
from dselectk.gates.comet import tree_leaf_probabilities
from dselectk.optim import RowwiseAdam
from dselectk.schedules import (
    AttributeScheduler,
    GeometricSchedule,
    LinearSchedule,
    Schedule,
    WarmupSchedule,
)
from dselectk.search import SwapSearch
from dselectk.telemetry import RoutingTelemetry
from dselectk.training import Callback, History, TaskData, TrainConfig, train

__all__ = ["RecoveryData", "RecoveryMoE", "generate_data", "train_reps"]

EXPERIMENT = "recovery"
NUM_TRUE = 4
NUM_EXPERTS = 16
UNITS = 4
FEATURES = 10
K = 4
BATCH_SIZE = 256
LRS = [1e-1, 1e-2, 1e-3, 1e-4, 1e-5]
# The variants kept after the collapse study (docs/collapse.md; the retired remedies are at the
# git tag pre-remedy-deletion): the paper's gates, COMET, and swap local search.
_PAPER: dict[str, Any] = {"init": "paper"}
_Variant = tuple[str, dict[str, Any], dict[str, float] | None, dict[str, float] | None]
#: experiment gate name → (registry name, constructor kwargs, λ warm-up, γ anneal)
_VARIANTS: dict[str, _Variant] = {
    "dselect_k": ("dselect_k", _PAPER, None, None),
    "topk": ("topk", {}, None, None),
    # COMET's tree gate (Ibrahim et al., KDD 2023): k smooth-step trees, DSelect-k's γ and λ
    "comet": ("comet", {}, None, None),
    # swap local search (dselectk.search; ours): the gate as above, searched during training
    "dselect_k_search": ("dselect_k", _PAPER, None, None),
    "topk_search": ("topk", {}, None, None),
}
GATES: dict[str, tuple[str, dict[str, Any]]] = {
    name: (reg, dict(kw)) for name, (reg, kw, _, _) in _VARIANTS.items()
}
WARMUPS: dict[str, dict[str, float]] = {
    name: dict(w) for name, (_, _, w, _) in _VARIANTS.items() if w is not None
}
ANNEALS: dict[str, dict[str, float]] = {
    name: dict(a) for name, (_, _, _, a) in _VARIANTS.items() if a is not None
}
# swap local search of some variants (dselectk.search.SwapSearch): after the fractions ``at``
# of the training steps, scored by each repetition's data loss on a fixed probe of the
# training set; at ``binarize`` (DSelect-k) fractional selectors must take their best code
SEARCHES: dict[str, dict[str, Any]] = {
    "dselect_k_search": {"at": (0.25, 0.7, 0.85), "binarize": 0.5},
    "topk_search": {"at": (0.25, 0.5, 0.7, 0.85), "binarize": None},
}
SEARCH_PROBE = 2048


class _Held(Schedule):
    """``before`` for ``delay`` steps, then ``inner`` shifted by ``delay``."""

    def __init__(self, inner: Schedule, delay: int, before: float) -> None:
        self.inner, self.delay, self.before = inner, int(delay), float(before)

    def __call__(self, step: int) -> Any:
        return self.before if step < self.delay else self.inner(step - self.delay)


LABELS = {
    "dselect_k": "DSelect-k (paper init)",
    "topk": "Top-k",
    "comet": "COMET tree gate (Ibrahim et al. 2023)",
    "dselect_k_search": "DSelect-k (paper) + swap local search (ours)",
    "topk_search": "Top-k + swap local search (ours)",
}
PAPER = {"dselect_k": 4, "topk": 1}
BASE_HPARAMS: dict[str, Any] = {
    "epochs": 50,
    "gamma": 10.0,
    "entropy_reg": 0.1,
    "entropy_reg_end": None,
}


class RecoveryData:
    """The generated classification data and the generating experts.

    Attributes:
        x_train, y_train, x_val, y_val: (10k, 10) inputs and (10k,) {0, 1} labels.
        true_experts: (4, 10, 4) generating experts' weights.
    """

    def __init__(self, seed: int = 0, n_train: int = 10_000, n_val: int = 10_000) -> None:
        g = torch.Generator().manual_seed(seed)
        self.true_experts = torch.randn(NUM_TRUE, FEATURES, UNITS, generator=g)
        head = torch.randn(UNITS, generator=g)
        x = torch.randn(n_train + n_val, FEATURES, generator=g)
        h = expert_outputs(x, self.true_experts).mean(0)  # (N, 4): average of the experts
        pre = h @ head
        pre = pre - pre.median()
        y = (pre > 0).float()
        self.x_train, self.y_train = x[:n_train], y[:n_train]
        self.x_val, self.y_val = x[n_train:], y[n_train:]
        self.seed = seed


def generate_data(seed: int = 0, n_train: int = 10_000, n_val: int = 10_000) -> RecoveryData:
    """Deterministic data set of Appendix C.2.2 (private generator; global RNG untouched)."""
    return RecoveryData(seed, n_train, n_val)


def expert_outputs(x: Tensor, weights: Tensor) -> Tensor:
    """ReLU dense experts without bias: x (B, p), weights (..., E, p, u) → (..., E, B, u)."""
    return torch.relu(torch.einsum("bp,...epu->...ebu", x, weights))


class RecoveryMoE(nn.Module):
    """R independent recovery models as one vectorized model.

    Args:
        gate: experiment gate name (:data:`GATES`).
        hparams: γ and λ of DSelect-k.
        data: the data (its true experts are copied into the banks).
        init_seeds: one per repetition; repetition r draws its copy positions, random experts,
            gate and head under ``torch.manual_seed(init_seeds[r])``.
    """

    true_mask: Tensor
    experts: Tensor

    def __init__(
        self,
        gate: str,
        hparams: Mapping[str, Any],
        data: RecoveryData,
        init_seeds: Sequence[int],
    ) -> None:
        super().__init__()
        reg, fixed = GATES[gate]
        kw: dict[str, Any] = {"k": K, **fixed}
        if reg in ("dselect_k", "comet"):
            kw["gamma"] = float(hparams["gamma"])
            kw["entropy_reg"] = float(hparams.get("entropy_reg") or 0.0)
        self.reps = len(init_seeds)
        banks, masks, logits, heads_w, heads_b = [], [], [], [], []
        for s in init_seeds:
            torch.manual_seed(int(s))
            pos = torch.randperm(NUM_EXPERTS)[:NUM_TRUE]
            bank = torch.randn(NUM_EXPERTS, FEATURES, UNITS)
            bank[pos] = data.true_experts
            mask = torch.zeros(NUM_EXPERTS, dtype=torch.bool)
            mask[pos] = True
            g = make_gate(reg, NUM_EXPERTS, **kw)
            head = nn.Linear(UNITS, 1)
            banks.append(bank)
            masks.append(mask)
            logits.append(g.logits.detach())
            heads_w.append(head.weight.detach()[0])
            heads_b.append(head.bias.detach())
        self.register_buffer("experts", torch.stack(banks))  # (R, 16, 10, 4), frozen
        self.register_buffer("true_mask", torch.stack(masks))  # (R, 16)
        self.gates: Gate = make_gate(reg, NUM_EXPERTS, num_gates=self.reps, **kw)
        with torch.no_grad():
            self.gates.logits.copy_(torch.stack(logits))
        self.head_w = nn.Parameter(torch.stack(heads_w))  # (R, 4)
        self.head_b = nn.Parameter(torch.cat(heads_b))  # (R,)

    def features(self, x: Tensor) -> Tensor:
        """Frozen expert outputs (B, R, 16, 4), examples first so that a mini-batch is one
        contiguous gather (precomputed once for the whole data set)."""
        return expert_outputs(x, self.experts).permute(2, 0, 1, 3).contiguous()

    def forward(self, feats: Tensor) -> tuple[Tensor, Tensor]:
        """Logits (R, B) from precomputed expert outputs, and the gates' summed aux loss."""
        out = self.gates()
        h = torch.einsum("rn,brnu->rbu", out.weights, feats)
        return torch.einsum("rbu,ru->rb", h, self.head_w) + self.head_b.unsqueeze(-1), out.aux_loss

    @torch.no_grad()
    def weights(self) -> Tensor:
        """(R, 16) current gate weights."""
        return self.gates.expert_weights()


@torch.no_grad()
def _evaluate(model: RecoveryMoE, feats: Tensor, y: Tensor) -> list[dict[str, float]]:
    logits, _ = model(feats)
    loss = F.binary_cross_entropy_with_logits(logits, y.expand_as(logits), reduction="none").mean(
        -1
    )
    acc = ((logits > 0).float() == y).float().mean(-1)
    w = model.weights()
    rec = recovered_experts(w, model.true_mask, K)
    nsel = (w > 0).sum(-1)
    binary = None
    if isinstance(model.gates, DSelectK):
        p = model.gates.bits()
        binary = ((p == 0) | (p == 1)).flatten(1).all(-1)
    elif isinstance(model.gates, COMETGate):  # binary: every tree reaches exactly one leaf
        leaves, _ = tree_leaf_probabilities(model.gates.splits(), NUM_EXPERTS)
        binary = ((leaves == 0) | (leaves == 1)).flatten(1).all(-1)
    out = []
    for r in range(model.reps):
        m = {
            "val_loss": float(loss[r]),
            "val_accuracy": float(acc[r]),
            "recovered": float(rec[r]),
            "all_recovered": float(rec[r] == NUM_TRUE),
            "experts_selected": float(nsel[r]),
        }
        if binary is not None:
            m["binary"] = float(binary[r])
        out.append(m)
    return out


class _Trajectories(Callback):
    """Records the gate weights of some repetitions every ``every`` steps."""

    def __init__(self, model: RecoveryMoE, reps: Sequence[int], every: int) -> None:
        self.every = every
        self.trajs: dict[int, dict[str, Any]] = {
            r: {"steps": [], "weights": [], "true": model.true_mask[r].nonzero().flatten().tolist()}
            for r in (reps if every else ())
        }
        if every:
            self.record(model, 0)

    def record(self, model: RecoveryMoE, step: int) -> None:
        w = model.weights()
        for r, tr in self.trajs.items():
            tr["steps"].append(step)
            tr["weights"].append([round(float(v), 5) for v in w[r]])

    def on_step(self, model: nn.Module, batch: TaskData, out: Any, history: History) -> None:
        if self.every and history.steps % self.every == 0:
            assert isinstance(model, RecoveryMoE)
            self.record(model, history.steps)


def _loss(model: nn.Module, batch: TaskData) -> tuple[Tensor, None]:
    """Σ_r mean BCE of repetition r + the gates' auxiliary losses."""
    logits, aux = model(batch.x)
    y = batch.ys[0]
    bce = F.binary_cross_entropy_with_logits(logits, y.expand_as(logits), reduction="none")
    return bce.mean(-1).sum() + aux, None


def _search(
    model: RecoveryMoE, data: RecoveryData, gate: str, steps_total: int, seed: int
) -> SwapSearch:
    """The swap search of ``gate``: each candidate selection is scored by every repetition's
    BCE on a fixed probe of the training set *after refitting the head* to it (a move changes
    the features the head reads; scored with the old head, a move towards the true experts can
    look worse than the wrong selection the head was fitted to). The model's head is not changed.
    """
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(data.y_train.shape[0], generator=g)[:SEARCH_PROBE]
    feats, y = model.features(data.x_train[idx]), data.y_train[idx]

    def member_loss() -> Tensor:
        h = torch.einsum("rn,brnu->rbu", model.gates().weights, feats)  # (R, B, 4)
        w = torch.cat([model.head_w, model.head_b.unsqueeze(-1)], -1).detach()  # (R, 5)
        return _refit_bce(torch.cat([h, torch.ones_like(h[..., :1])], -1), y, w)

    return SwapSearch.from_plan(model.gates, member_loss, steps_total, SEARCHES[gate])


def _refit_bce(h: Tensor, y: Tensor, w: Tensor, iters: int = 8, l2: float = 1e-3) -> Tensor:
    """(R,) mean BCE of logistic regressions of y on h (R, B, d), each refitted from w (R, d)
    by ``iters`` Newton steps on BCE + l2·|w|² (a tiny ridge keeps separable data finite)."""
    eye = torch.eye(h.shape[-1], dtype=h.dtype)
    for _ in range(iters):
        p = torch.sigmoid(torch.einsum("rbd,rd->rb", h, w))
        grad = torch.einsum("rbd,rb->rd", h, p - y) / h.shape[1] + 2 * l2 * w
        hess = torch.einsum("rbd,rb,rbe->rde", h, p * (1 - p), h) / h.shape[1] + 2 * l2 * eye
        w = w - torch.linalg.solve(hess, grad.unsqueeze(-1)).squeeze(-1)
    logits = torch.einsum("rbd,rd->rb", h, w)
    return F.binary_cross_entropy_with_logits(logits, y.expand_as(logits), reduction="none").mean(
        -1
    )


def train_reps(
    gate: str,
    hparams: Mapping[str, Any],
    data: RecoveryData,
    init_seeds: Sequence[int],
    *,
    shuffle_seed: int,
    lrs: Sequence[float] | None = None,
    record_every: int = 0,
    record_reps: Sequence[int] = (0,),
    progress: bool = False,
    desc: str = "",
    telemetry_dir: Path | None = None,
) -> tuple[list[dict[str, float]], dict[int, dict[str, Any]]]:
    """Train R repetitions together; return their final metrics and weight trajectories.

    Args:
        gate, hparams, data: the gate, its hyperparameters (``lr`` unless ``lrs``), the data.
        init_seeds: one per repetition (repeat a seed to pair repetitions across lrs).
        shuffle_seed: seed of the mini-batch order, shared by all repetitions.
        lrs: one learning rate per repetition (default ``hparams["lr"]`` for all).
        record_every: record the gate weights of ``record_reps`` every N steps (0: never).
        telemetry_dir: log routing telemetry of every repetition's gate there (``gates/task<r>``
            is repetition r): binary fraction, selector collisions, entropy, experts, every
            ``record_every`` steps (or 10).

    Returns:
        (metrics per repetition, {rep: {"steps", "weights" (S x 16), "true" positions}}).
    """
    model = RecoveryMoE(gate, hparams, data, init_seeds)
    rates = [float(hparams["lr"])] * model.reps if lrs is None else [float(v) for v in lrs]
    if len(rates) != model.reps:
        raise ValueError(f"lrs must give one learning rate per repetition ({model.reps})")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = RowwiseAdam(params, torch.tensor(rates))
    n = data.y_train.shape[0]
    epochs = int(hparams["epochs"])
    steps_total = epochs * math.ceil(n / BATCH_SIZE)
    scheds = []
    if GATES[gate][0] == "dselect_k" and hparams.get("entropy_reg_end") is not None:
        sched = LinearSchedule(
            float(hparams.get("entropy_reg") or 0.0), float(hparams["entropy_reg_end"]), steps_total
        )
        scheds.append(AttributeScheduler(model.gates, "entropy_reg", sched))
    elif gate in WARMUPS:
        warm = WARMUPS[gate]
        ramp = LinearSchedule(
            0.0, float(hparams.get("entropy_reg") or 0.0), max(1, int(warm["ramp"] * steps_total))
        )
        delayed = WarmupSchedule(ramp, int(warm["delay"] * steps_total))
        scheds.append(AttributeScheduler(model.gates, "entropy_reg", delayed))
    if gate in ANNEALS:
        ann, gamma = ANNEALS[gate], float(hparams["gamma"])
        geo = GeometricSchedule(
            gamma, gamma * ann["factor"], max(1, int(ann["steps"] * steps_total))
        )
        held = _Held(geo, int(ann["delay"] * steps_total), gamma)
        scheds.append(AttributeScheduler(model.gates, "gamma", held))
    recorder = _Trajectories(model, record_reps, record_every)
    callbacks: list[Any] = [recorder]
    if gate in SEARCHES:
        callbacks.append(_search(model, data, gate, steps_total, shuffle_seed))
    if telemetry_dir is not None:
        callbacks.append(RoutingTelemetry(telemetry_dir, every=record_every or 10))
    config = TrainConfig.for_members(
        lr=max(rates),
        batch_size=BATCH_SIZE,
        epochs=epochs,
        shuffle_seed=shuffle_seed,
        progress=progress,
        desc=desc,
        position=progress_position(),
    )
    train_data = TaskData(model.features(data.x_train), [data.y_train])
    train(
        model,
        train_data,
        None,
        config,
        schedulers=scheds,
        optimizer=opt,
        callbacks=callbacks,
        loss_fn=_loss,
    )
    return _evaluate(model, model.features(data.x_val), data.y_val), recorder.trajs
