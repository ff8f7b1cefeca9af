"""Optimizers beyond ``torch.optim``: one Adam whose learning rate differs between the members
of a vectorized model.

A *vectorized model* stacks R independent models (repetitions, or the configurations of a grid
search) along the leading dimension of every parameter, member-major: rows
``[r * c, (r + 1) * c)`` of a parameter with ``R * c`` rows belong to member r. Adam is
elementwise, so one optimizer over the stacked parameters follows the same trajectories as R
separate ``torch.optim.Adam`` runs — as long as each member can have its own learning rate,
which is what :class:`RowwiseAdam` adds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["RowwiseAdam"]


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
