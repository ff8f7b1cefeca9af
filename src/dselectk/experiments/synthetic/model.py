"""R independent multi-gate MoEs of the synthetic study as one vectorized model.

Each member (a repetition, or one configuration of the grid search) has E experts of the
generator's form and one static gate per task choosing k; all members' experts are one
:class:`~dselectk.layers.StackedMLP` and all their gates one bank of R·T library gates, whose
γ, λ and temperature may differ per member (per-gate hyperparameters of the library gates).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dselectk.data.synthetic import FEATURES, UNITS, SyntheticData
from dselectk.experiments.metrics import distinct_experts, pairwise_jaccard
from dselectk.experiments.synthetic.spec import K, hparam_keys, variant_of
from dselectk.gates.base import Gate
from dselectk.layers import StackedMLP
from dselectk.schedules import AttributeScheduler, GeometricSchedule, Schedule
from dselectk.variants import Variant, stack_members

__all__ = ["SyntheticMoE", "evaluate_model", "schedulers"]


class SyntheticMoE(nn.Module):
    """R independent multi-gate MoEs (T tasks, E experts each) as one vectorized model.

    Args:
        gate: a variant (or its name, :data:`~dselectk.experiments.synthetic.spec.VARIANTS`).
        num_tasks: T.
        hparams: resolved hyperparameters (γ, λ, start temperature).
        init_seeds: one seed per repetition; repetition r's parameters are those a single model
            built under ``torch.manual_seed(init_seeds[r])`` gets.
        member_hparams: one mapping per seed overriding ``hparams`` for that member (per-gate
            γ, λ, temperature; per-member learning rate and epochs for the optimizer and
            schedules).
        num_experts: E (default T/4, the generator's number of experts).
        k: experts each task's gate selects.
    """

    def __init__(
        self,
        gate: str | Variant,
        num_tasks: int,
        hparams: Mapping[str, Any],
        init_seeds: Sequence[int],
        member_hparams: Sequence[Mapping[str, Any]] | None = None,
        *,
        num_experts: int | None = None,
        k: int = K,
    ) -> None:
        super().__init__()
        self.variant = v = variant_of(gate)
        if member_hparams is not None and len(member_hparams) != len(init_seeds):
            raise ValueError(
                f"member_hparams needs one entry per seed ({len(init_seeds)}), "
                f"got {len(member_hparams)}"
            )
        if num_experts is None and num_tasks % 4:
            raise ValueError(f"num_tasks must be a multiple of 4, got {num_tasks}")
        if not init_seeds:
            raise ValueError("init_seeds must hold at least one seed")
        self.gate_name = v.name
        self.num_tasks, self.k, self.reps = num_tasks, k, len(init_seeds)
        self.num_experts = e = num_tasks // 4 if num_experts is None else num_experts
        self.member_hparams = (
            None if member_hparams is None else [{**hparams, **m} for m in member_hparams]
        )
        keys = hparam_keys(v)  # the hyperparameters the study gives this variant
        members: Sequence[Mapping[str, Any]] = [hparams] * self.reps
        if self.member_hparams is not None:
            members = self.member_hparams
        experts, gates = [], []
        for s, hp_i in zip(init_seeds, members, strict=True):
            torch.manual_seed(int(s))
            experts.append(StackedMLP(e, FEATURES, [UNITS]))
            own = {n: x for n, x in hp_i.items() if n in keys}
            gates.append(v.build(e, hparams=own, k=k, num_gates=num_tasks))
        bank_hp = {n: x for n, x in hparams.items() if n in keys}
        if self.member_hparams is not None:  # per-gate values: member r's, over its T gates
            used = [n for n in keys if any(m.get(n) is not None for m in members)]
            bank_hp = {n: self.member_values(n).repeat_interleave(num_tasks) for n in used}
        self.experts = StackedMLP(self.reps * e, FEATURES, [UNITS])
        self.gates: Gate = v.build(e, hparams=bank_hp, k=k, num_gates=self.reps * num_tasks)
        stack_members(self.experts, experts)
        stack_members(self.gates, gates)

    def member_values(self, key: str, default: float = 0.0) -> Tensor:
        """(R,) float64 values of one hyperparameter, one per member."""
        hps = self.member_hparams or [{}] * self.reps
        return torch.tensor([float(h.get(key) or default) for h in hps], dtype=torch.float64)

    def expert_outputs(self, x: Tensor) -> Tensor:
        """(R, E, B): every expert of every repetition on the shared batch (one batched op)."""
        return self.experts(x).sum(-1).view(self.reps, self.num_experts, -1)

    def forward(self, x: Tensor, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Predictions (R, T, B) and the summed auxiliary loss of all R·T gates."""
        if weights is None:
            out = self.gates()
            weights, aux = out.weights, out.aux_loss
        else:
            aux = x.new_zeros(())
        w = weights.view(self.reps, self.num_tasks, self.num_experts)
        return torch.bmm(w, self.expert_outputs(x)), aux

    @torch.no_grad()
    def eval_weights(self) -> Tensor:
        """Weights used at evaluation, (R, T, E): the ablation gates' argmax heuristic applied
        (``Gate.inference_weights``)."""
        w = self.gates.inference_weights()
        return w.view(self.reps, self.num_tasks, self.num_experts)

    @torch.no_grad()
    def soft_weights(self) -> Tensor:
        """The gates' own (soft) weights, (R, T, E)."""
        return self.gates.expert_weights().view(self.reps, self.num_tasks, self.num_experts)


def schedulers(
    model: SyntheticMoE, hp: Mapping[str, Any], total_steps: int, steps_per_epoch: int
) -> list[AttributeScheduler]:
    """The variant's ramps (:class:`~dselectk.variants.Ramp`) for a run of ``total_steps``.
    With per-member hyperparameters, each member's ramp starts at its own value, and a
    geometric ramp without delay (the annealing) spans each member's own epochs."""
    v = model.variant
    if model.member_hparams is None:
        return v.schedulers(model.gates, hp, max(1, total_steps))
    t = model.num_tasks
    totals = (model.member_values("epochs") * steps_per_epoch).repeat_interleave(t)
    out = []
    for r in v.schedules:
        start = model.member_values(r.param).repeat_interleave(t) if r.start is None else r.start
        sched: Schedule
        if r.shape == "geometric" and not r.delay and r.span is None and r.end is not None:
            sched = GeometricSchedule(start, r.end, totals)
        elif bool((totals == totals[0]).all()):
            sched = r.schedule(start, int(totals[0]))
        else:
            raise ValueError(f"{r}: members of different epochs need a geometric ramp")
        out.append(AttributeScheduler(model.gates, r.param, sched))
    return out


@torch.no_grad()
def _mse(model: SyntheticMoE, x: Tensor, y: Tensor, weights: Tensor, chunk: int = 1024) -> Tensor:
    """(R,) MSE averaged over tasks and examples; ``y`` is (N, T)."""
    total = torch.zeros(model.reps, dtype=torch.float64)
    flat = weights.reshape(-1, model.num_experts)
    for s in range(0, x.shape[0], chunk):
        pred, _ = model(x[s : s + chunk], flat)
        err = (pred - y[s : s + chunk].T.unsqueeze(0)) ** 2
        total += err.sum((1, 2)).double()
    return total / (x.shape[0] * model.num_tasks)


@torch.no_grad()
def evaluate_model(model: SyntheticMoE, data: SyntheticData) -> list[dict[str, float]]:
    """Metrics of each repetition: MSEs, Jaccard indices, experts per task, binarization."""
    t = model.num_tasks
    w = model.eval_weights()
    yv, yt = data.y_val[:, :t], data.y_test[:, :t]
    val = _mse(model, data.x_val, yv, w)
    test = _mse(model, data.x_test, yt, w)
    sel = w > 0
    rel, unrel = pairwise_jaccard(sel, data.groups[:t])
    nsel = distinct_experts(sel).double()  # (R, T)
    out: list[dict[str, float]] = []
    soft_test = None
    if model.gates.posthoc_inference:  # the ablations: their own soft weights, too
        soft_test = _mse(model, data.x_test, yt, model.soft_weights())
    binary = None
    if model.gates.binarizes:  # DSelect-k: which bits of S(Z) are exactly 0 or 1
        is_bin = model.gates.binary_entries().view(model.reps, t, -1)
        binary = (is_bin.flatten(2).float().mean(-1), is_bin.flatten(1).float().mean(-1))
    for r in range(model.reps):
        m = {
            "val_mse": float(val[r]),
            "test_mse": float(test[r]),
            "related_jaccard": float(rel[r]),
            "unrelated_jaccard": float(unrel[r]),
            "experts_per_task": float(nsel[r].mean()),
            "experts_per_task_min": float(nsel[r].min()),
            "experts_per_task_max": float(nsel[r].max()),
            "frac_tasks_k_experts": float((nsel[r] == model.k).double().mean()),
        }
        if soft_test is not None:
            m["test_mse_soft"] = float(soft_test[r])
        if binary is not None:
            m["frac_binary_entries"] = float(binary[1][r])
            m["frac_tasks_binary"] = float((binary[0][r] == 1).double().mean())
            m["all_binary"] = float(bool((binary[0][r] == 1).all()))
        out.append(m)
    return out
