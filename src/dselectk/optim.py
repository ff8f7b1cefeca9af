"""Optimizers beyond ``torch.optim``: one Adam whose learning rate differs between the members
of a vectorized model.

A *vectorized model* stacks R independent models (repetitions, or the configurations of a grid
search) along the leading dimension of every parameter, member-major: rows
``[r * c, (r + 1) * c)`` of a parameter with ``R * c`` rows belong to member r. Adam is
elementwise, so one optimizer over the stacked parameters follows the same trajectories as R
separate ``torch.optim.Adam`` runs — as long as each member can have its own learning rate,
which is what :class:`RowwiseAdam` adds.

The reference optimizers (:func:`make_reference_optimizer`): the paper's models were trained
with TensorFlow 2 / Keras, whose optimizer defaults differ from torch's. TF2's Keras
``Adagrad`` (``ResourceApplyAdagradV2``) updates ``accum ← accum + g²``,
``θ ← θ − lr · g / (√accum + ε)`` with ``initial_accumulator_value = 0.1`` and ``ε = 1e-7``;
``torch.optim.Adagrad`` (no ``lr_decay``, no weight decay) applies exactly this update, with
defaults 0 and 1e-10: the TF-compatible Adagrad is ``torch.optim.Adagrad`` with TF's values
(:data:`TF_ADAGRAD_DEFAULTS`). Keras ``Adam`` uses ε = 1e-7 (torch: 1e-8) and adds it to √v
before the bias correction (torch: after it), i.e. torch's update with ε/√(1 − β₂ᵗ) (3e-6 at
step 1, → 1e-7); :data:`TF_ADAM_DEFAULTS` sets ε = 1e-7 and leaves that small difference.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "OPTIMIZER_DEFAULTS",
    "TF_ADAGRAD_DEFAULTS",
    "TF_ADAM_DEFAULTS",
    "RowwiseAdam",
    "make_reference_optimizer",
    "tf_adagrad",
]

#: TF2 Keras ``Adagrad``'s defaults, as ``torch.optim.Adagrad`` keywords.
TF_ADAGRAD_DEFAULTS: dict[str, float] = {"initial_accumulator_value": 0.1, "eps": 1e-7}
#: TF2 Keras ``Adam``'s defaults, as ``torch.optim.Adam`` keywords (β's are torch's too).
TF_ADAM_DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-7}
#: names accepted by :func:`make_reference_optimizer`'s ``defaults``
OPTIMIZER_DEFAULTS = ("tf", "torch")


def tf_adagrad(
    params: Iterable[Tensor] | Iterable[dict[str, Any]],
    lr: float = 1e-3,
    *,
    initial_accumulator_value: float = 0.1,
    eps: float = 1e-7,
) -> torch.optim.Adagrad:
    """TF2 Keras' Adagrad: ``torch.optim.Adagrad`` (same update) with TF's default values.

    ``accum₀ = initial_accumulator_value``; each step ``accum ← accum + g²`` and
    ``θ ← θ − lr · g / (√accum + eps)``.
    """
    return torch.optim.Adagrad(
        params, lr=lr, initial_accumulator_value=initial_accumulator_value, eps=eps, foreach=True
    )


def make_reference_optimizer(
    name: str, params: Iterable[Tensor], lr: float, defaults: str = "tf"
) -> torch.optim.Optimizer:
    """ "adagrad" or "adam" with TF2 Keras' defaults (``defaults="tf"``) or torch's ("torch").

    Args:
        name: "adagrad" or "adam".
        params: the parameters.
        lr: learning rate.
        defaults: "tf" (:data:`TF_ADAGRAD_DEFAULTS` / :data:`TF_ADAM_DEFAULTS`) or "torch".
    """
    if defaults not in OPTIMIZER_DEFAULTS:
        raise ValueError(f"defaults must be one of {OPTIMIZER_DEFAULTS}, got {defaults!r}")
    tf = defaults == "tf"
    if name == "adagrad":
        kw: dict[str, Any] = dict(TF_ADAGRAD_DEFAULTS) if tf else {}
        return torch.optim.Adagrad(params, lr=lr, foreach=True, **kw)
    if name == "adam":
        kw = dict(TF_ADAM_DEFAULTS) if tf else {}
        return torch.optim.Adam(params, lr=lr, foreach=True, **kw)
    raise ValueError(f"name must be adagrad or adam, got {name!r}")


class RowwiseAdam(torch.optim.Optimizer):
    """Adam (Kingma & Ba; no weight decay, no amsgrad) with one learning rate per member.

    The update of each element is Adam's,
    ``p ← p − lr_r · m̂ / (√v̂ + ε)`` with ``m̂ = m / (1 − β₁ᵗ)``, ``v̂ = v / (1 − β₂ᵗ)``,
    where ``lr_r`` is the learning rate of the member that owns the element's row. Tested
    against R runs of ``torch.optim.Adam`` (equal up to float rounding: torch orders the
    division differently).

    Args:
        params: parameters whose leading dimension is a multiple of R (member-major rows).
        lr: one learning rate for all members (float) or one per member (R values).
        betas, eps: as ``torch.optim.Adam``.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float | Sequence[float] | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        rates = torch.as_tensor(lr, dtype=torch.float32).reshape(-1)
        if rates.numel() == 0 or not bool(((rates > 0) & torch.isfinite(rates)).all()):
            raise ValueError(f"lr must hold finite values > 0, got {rates.tolist()}")
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if not (eps >= 0.0 and math.isfinite(eps)):
            raise ValueError(f"eps must be a finite number >= 0, got {eps}")
        params = list(params)
        members = rates.numel()
        for p in params:
            if p.dim() == 0 or p.shape[0] % members:
                raise ValueError(
                    f"lr has {members} members but a parameter of shape {tuple(p.shape)} "
                    f"does not have a multiple of {members} rows"
                )
        super().__init__(params, {"betas": (float(b1), float(b2)), "eps": float(eps)})
        self.lr = rates
        self._row_lr: dict[int, Tensor] = {}

    @property
    def num_members(self) -> int:
        """R, the number of members (learning rates)."""
        return int(self.lr.numel())

    def _rows(self, p: Tensor) -> Tensor:
        """The learning rate of each row of ``p``, shaped to broadcast over it (cached)."""
        key = id(p)
        cached = self._row_lr.get(key)
        if cached is None or cached.device != p.device:
            per_row = self.lr.repeat_interleave(p.shape[0] // self.num_members).to(p)
            cached = per_row.view(-1, *([1] * (p.dim() - 1)))
            self._row_lr[key] = cached
        return cached

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One Adam step (``closure`` is not supported)."""
        if closure is not None:
            raise ValueError("RowwiseAdam.step does not take a closure")
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                bc1 = 1 - b1 ** st["step"]
                denom = (v.sqrt() / math.sqrt(1 - b2 ** st["step"])).add_(group["eps"])
                p.sub_(m / denom * (self._rows(p) / bc1))
