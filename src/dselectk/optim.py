"""Optimizers beyond ``torch.optim``: one Adam whose learning rate differs between the members
of a vectorized model.

A *vectorized model* stacks R independent models (repetitions, or the configurations of a grid
search) along the leading dimension of every parameter, member-major: rows
``[r * c, (r + 1) * c)`` of a parameter with ``R * c`` rows belong to member r. Adam is
elementwise, so one optimizer over the stacked parameters follows the same trajectories as R
separate ``torch.optim.Adam`` runs — as long as each member can have its own learning rate,
which is what :class:`RowwiseAdam` adds.

One factory builds every other optimizer: :func:`make_optimizer` (Adam, Adagrad or SGD, the
``foreach`` implementations), with torch's default constants or TF2 Keras' (``defaults="tf"``).
The paper's models were trained with TensorFlow 2 / Keras, whose optimizer defaults differ from
torch's. TF2's Keras ``Adagrad`` (``ResourceApplyAdagradV2``) updates ``accum ← accum + g²``,
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
    "OPTIMIZERS",
    "OPTIMIZER_DEFAULTS",
    "TF_ADAGRAD_DEFAULTS",
    "TF_ADAM_DEFAULTS",
    "RowwiseAdam",
    "make_optimizer",
]

#: TF2 Keras ``Adagrad``'s defaults, as ``torch.optim.Adagrad`` keywords.
TF_ADAGRAD_DEFAULTS: dict[str, float] = {"initial_accumulator_value": 0.1, "eps": 1e-7}
#: TF2 Keras ``Adam``'s defaults, as ``torch.optim.Adam`` keywords (β's are torch's too).
TF_ADAM_DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-7}
#: names accepted by :func:`make_optimizer`'s ``name`` (and ``TrainConfig.optimizer``)
OPTIMIZERS = ("adam", "adagrad", "sgd")
#: names accepted by :func:`make_optimizer`'s ``defaults``
OPTIMIZER_DEFAULTS = ("tf", "torch")

_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
}
_TF_DEFAULTS: dict[str, dict[str, Any]] = {"adam": TF_ADAM_DEFAULTS, "adagrad": TF_ADAGRAD_DEFAULTS}


def _finite_number(name: str, value: Any, *, positive: bool) -> float:
    """``value`` as a float, or a ValueError naming ``name`` (finite, > 0 or >= 0)."""
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or (v <= 0 if positive else v < 0):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return v


def make_optimizer(
    name: str,
    params: Iterable[Tensor] | Iterable[dict[str, Any]],
    lr: float,
    weight_decay: float = 0.0,
    *,
    defaults: str = "torch",
) -> torch.optim.Optimizer:
    """Adam, Adagrad or SGD over ``params`` (torch's ``foreach`` implementations).

    The optimizer :func:`~dselectk.training.train` builds from ``TrainConfig.optimizer``, and
    the TF2-Keras-compatible ones of the paper's setup (``defaults="tf"``): Adagrad with
    :data:`TF_ADAGRAD_DEFAULTS` (accumulator 0.1, ε = 1e-7; the same update as TF2's, see the
    module doc), Adam with :data:`TF_ADAM_DEFAULTS` (ε = 1e-7).

    Args:
        name: "adam", "adagrad" or "sgd" (:data:`OPTIMIZERS`).
        params: the parameters (or parameter groups).
        lr: learning rate, a finite number > 0.
        weight_decay: L2 weight decay added to the gradient (torch's), a finite number >= 0.
        defaults: "torch" (torch's constants) or "tf" (TF2 Keras', for adam and adagrad; Keras
            decouples its weight decay, so "tf" takes ``weight_decay=0`` only).

    Returns:
        ``torch.optim.Adam``, ``torch.optim.Adagrad`` or ``torch.optim.SGD``.

    Raises:
        ValueError: an unknown ``name`` or ``defaults``, ``lr`` not finite and > 0,
            ``weight_decay`` not finite and >= 0, or ``defaults="tf"`` with sgd or with weight
            decay.

    Examples:
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> opt = make_optimizer("adagrad", [p], 0.1, defaults="tf")
        >>> type(opt).__name__, opt.param_groups[0]["eps"], opt.state[p]["sum"]
        ('Adagrad', 1e-07, tensor([0.1000, 0.1000, 0.1000]))
        >>> p.grad = torch.tensor([1.0, -1.0, 0.0])
        >>> opt.step()
        >>> [round(v, 4) for v in p.tolist()]  # -0.1 * g / sqrt(0.1 + g**2)
        [-0.0953, 0.0953, 0.0]
        >>> make_optimizer("sgd", [p], 0.01, weight_decay=1e-4).param_groups[0]["weight_decay"]
        0.0001
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"name must be one of {OPTIMIZERS}, got {name!r}")
    if defaults not in OPTIMIZER_DEFAULTS:
        raise ValueError(f"defaults must be one of {OPTIMIZER_DEFAULTS}, got {defaults!r}")
    lr = _finite_number("lr", lr, positive=True)
    weight_decay = _finite_number("weight_decay", weight_decay, positive=False)
    kw: dict[str, Any] = {}
    if defaults == "tf":
        if name not in _TF_DEFAULTS:
            raise ValueError(
                f"defaults='tf' holds TF2 Keras' constants for adagrad or adam, not {name!r} "
                "(Keras' SGD has torch's: use defaults='torch')"
            )
        if weight_decay:
            raise ValueError(
                f"weight_decay must be 0 with defaults='tf' (Keras decouples weight decay from "
                f"the gradient, torch adds it), got {weight_decay}; use defaults='torch'"
            )
        kw = dict(_TF_DEFAULTS[name])
    return _CLASSES[name](params, lr=lr, weight_decay=weight_decay, foreach=True, **kw)


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

    Examples:
        >>> w = torch.nn.Parameter(torch.zeros(2 * 3, 4))  # R = 2 members of 3 rows each
        >>> opt = RowwiseAdam([w], lr=[0.1, 0.01])
        >>> w.grad = torch.ones(6, 4)
        >>> opt.step()
        >>> opt.num_members, [round(v, 4) for v in w[:, 0].tolist()]  # each row moves by its lr
        (2, [-0.1, -0.1, -0.1, -0.01, -0.01, -0.01])
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
