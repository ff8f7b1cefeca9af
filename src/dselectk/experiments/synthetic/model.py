"""R independent multi-gate MoEs of the synthetic study as one vectorized model.

Each member (a repetition, or one configuration of the grid search) has T/4 experts of the
generator's form and one static gate per task (k = 4); all members' experts are one
:class:`~dselectk.layers.StackedMLP` and all their gates one bank of R·T library gates, whose
γ, λ and temperature may differ per member (per-gate hyperparameters of the library gates).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dselectk.experiments.metrics import distinct_experts, pairwise_jaccard
from dselectk.experiments.synthetic.data import FEATURES, UNITS, SyntheticData
from dselectk.experiments.synthetic.spec import ANNEAL_END, GATES, K
from dselectk.gates import make_gate
from dselectk.gates.base import Gate
from dselectk.layers import StackedMLP
from dselectk.schedules import (
    AttributeScheduler,
    GeometricSchedule,
    LinearSchedule,
    WarmupSchedule,
)

__all__ = ["SyntheticMoE", "build_model", "evaluate_model", "gate_kwargs", "schedulers"]


def gate_kwargs(
    gate: str,
    hp: Mapping[str, Any],
    members: Sequence[Mapping[str, Any]] | None = None,
    num_tasks: int = 1,
) -> dict[str, Any]:
    """Constructor arguments of the library gate of experiment gate ``gate``.

    With ``members`` (one hyperparameter mapping per member), γ, λ, μ and the start
    temperature are per-gate values: member r's value repeated over its ``num_tasks`` gates.
    """
    reg, fixed = GATES[gate]
    kw: dict[str, Any] = {"k": K, **fixed}

    def value(key: str, default: float | None) -> Any:
        if members is None:
            return float(hp[key] if default is None else (hp.get(key) or default))
        vals = [float(m[key] if default is None else (m.get(key) or default)) for m in members]
        return torch.tensor(vals, dtype=torch.float64).repeat_interleave(num_tasks)

    if reg == "dselect_k":
        kw["gamma"] = value("gamma", None)
        kw["entropy_reg"] = value("entropy_reg", 0.0)
    elif reg == "ablation_entropy":
        kw["entropy_reg"] = value("entropy_reg", 0.0)
    elif reg == "ablation_annealing":
        kw["temperature"] = value("temperature_start", 1.0)
    return kw


class SyntheticMoE(nn.Module):
    """R independent multi-gate MoEs (T tasks, E experts each) as one vectorized model.

    Args:
        gate: an experiment gate name (:data:`~dselectk.experiments.synthetic.spec.GATES`).
        num_tasks: T.
        hparams: resolved hyperparameters (γ, λ, start temperature).
        init_seeds: one seed per repetition; repetition r's parameters are those a single model
            built under ``torch.manual_seed(init_seeds[r])`` gets.
        member_hparams: one mapping per seed overriding ``hparams`` for that member (per-gate
            γ, λ, μ, temperature; per-member learning rate and epochs for the optimizer and
            schedules).
    """

    def __init__(
        self,
        gate: str,
        num_tasks: int,
        hparams: Mapping[str, Any],
        init_seeds: Sequence[int],
        member_hparams: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        if gate not in GATES:
            raise ValueError(f"unknown gate {gate!r}; expected one of {sorted(GATES)}")
        if member_hparams is not None and len(member_hparams) != len(init_seeds):
            raise ValueError(
                f"member_hparams needs one entry per seed ({len(init_seeds)}), "
                f"got {len(member_hparams)}"
            )
        if num_tasks % 4:
            raise ValueError(f"num_tasks must be a multiple of 4, got {num_tasks}")
        self.gate_name = gate
        self.num_tasks = num_tasks
        self.num_experts = num_tasks // 4
        self.reps = len(init_seeds)
        if self.reps < 1:
            raise ValueError("init_seeds must hold at least one seed")
        reg, _ = GATES[gate]
        self.member_hparams = (
            None if member_hparams is None else [{**hparams, **m} for m in member_hparams]
        )
        singles = []
        for i, s in enumerate(init_seeds):
            torch.manual_seed(int(s))
            e = StackedMLP(self.num_experts, FEATURES, [UNITS])
            hp_i = hparams if self.member_hparams is None else self.member_hparams[i]
            g = make_gate(reg, self.num_experts, num_gates=num_tasks, **gate_kwargs(gate, hp_i))
            singles.append((e, g))
        self.experts = StackedMLP(self.reps * self.num_experts, FEATURES, [UNITS])
        kw = gate_kwargs(gate, hparams, self.member_hparams, num_tasks)
        self.gates: Gate = make_gate(reg, self.num_experts, num_gates=self.reps * num_tasks, **kw)
        with torch.no_grad():
            for name, p in self.experts.named_parameters():
                p.copy_(torch.cat([dict(e.named_parameters())[name] for e, _ in singles]))
            for name, p in self.gates.named_parameters():
                p.copy_(torch.cat([dict(g.named_parameters())[name] for _, g in singles]))

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


def build_model(
    gate: str, num_tasks: int, hparams: Mapping[str, Any], init_seeds: Sequence[int]
) -> SyntheticMoE:
    """A :class:`SyntheticMoE` (kept as a function for symmetry with the other experiments)."""
    return SyntheticMoE(gate, num_tasks, hparams, init_seeds)


def schedulers(
    model: SyntheticMoE, hp: Mapping[str, Any], total_steps: int, steps_per_epoch: int
) -> list[AttributeScheduler]:
    """The hyperparameter schedules of a run: γ anneal and λ ramp (DSelect-k), temperature
    anneal (Ablation (Annealing); per member over its own epochs when members differ)."""
    reg, _ = GATES[model.gate_name]
    out = []
    steps = max(1, total_steps)
    if model.member_hparams is not None:
        if reg == "ablation_annealing":
            t = model.num_tasks
            starts = model.member_values("temperature_start", 1.0).repeat_interleave(t)
            totals = (model.member_values("epochs") * steps_per_epoch).repeat_interleave(t)
            anneal = GeometricSchedule(starts, ANNEAL_END, totals)
            out.append(AttributeScheduler(model.gates, "temperature", anneal))
        return out
    if reg == "dselect_k":
        if hp.get("gamma_end"):
            out.append(
                AttributeScheduler(
                    model.gates, "gamma", GeometricSchedule(hp["gamma"], hp["gamma_end"], steps)
                )
            )
        lam = float(hp.get("entropy_reg") or 0.0)
        lam_end = hp.get("entropy_reg_end")
        if lam_end is not None:
            # Linear ramp λ → λ_end, optionally after a warm-up fraction with λ = 0.
            warm = int(float(hp.get("entropy_warmup") or 0.0) * steps)
            ramp = WarmupSchedule(LinearSchedule(lam, float(lam_end), max(1, steps - warm)), warm)
            out.append(AttributeScheduler(model.gates, "entropy_reg", ramp))
    elif reg == "ablation_annealing":
        start = float(hp.get("temperature_start") or 1.0)
        out.append(
            AttributeScheduler(
                model.gates, "temperature", GeometricSchedule(start, ANNEAL_END, steps)
            )
        )
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
            "frac_tasks_k_experts": float((nsel[r] == K).double().mean()),
        }
        if soft_test is not None:
            m["test_mse_soft"] = float(soft_test[r])
        if binary is not None:
            m["frac_binary_entries"] = float(binary[1][r])
            m["frac_tasks_binary"] = float((binary[0][r] == 1).double().mean())
            m["all_binary"] = float(bool((binary[0][r] == 1).all()))
        out.append(m)
    return out
