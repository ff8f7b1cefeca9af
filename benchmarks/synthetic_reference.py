"""Reference paths of the synthetic study (Appendix C.1), for the tests and the benchmarks only.

* :func:`reference_loss`: the training loss composed from autograd ops (the fused
  ``_MixtureSSE`` of :mod:`dselectk.models.bank` must equal it);
* :func:`train_step`: one plain optimizer step outside the library's loop (timed by
  ``bench_synthetic.py``);
* :func:`train_sequential`: repetitions trained one at a time (the batched model must follow
  the same trajectory).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dselectk.models import MoEBank
from dselectk.variants import Variant
from dselectk_research.data.synthetic import SyntheticData
from dselectk_research.synthetic.train import train_reps

LossFn = Callable[[MoEBank, Tensor, Tensor], Tensor]


def fused_loss(model: MoEBank, xb: Tensor, yb: Tensor) -> Tensor:
    """The training loss by the fused path (:meth:`MoEBank.loss`)."""
    return model.loss(xb, yb, fused=True)


def reference_loss(model: MoEBank, xb: Tensor, yb: Tensor) -> Tensor:
    """Σ_r [Σ_t MSE_t,r + aux_r] of a batch, composed from autograd ops."""
    pred, aux = model(xb)
    return (pred - yb.T.unsqueeze(0)).square().mean(-1).sum() + aux


def train_step(
    model: MoEBank,
    opt: torch.optim.Optimizer,
    xb: Tensor,
    yb: Tensor,
    scheds: Sequence[Any] = (),
    loss_fn: LossFn | None = None,
) -> None:
    """One step outside the loop: gradients of the loss (default the fused
    :meth:`~dselectk.models.MoEBank.loss`), the optimizer step, then every
    scheduler's step. ``xb``: (B, 10) batch shared by all repetitions; ``yb``: (B, T)."""
    loss = (loss_fn or fused_loss)(model, xb, yb)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    for s in scheds:
        s.step()


def train_sequential(
    gate: str | Variant,
    num_tasks: int,
    hparams: Mapping[str, Any],
    init_seeds: Sequence[int],
    data: SyntheticData,
    *,
    shuffle_seed: int,
) -> list[dict[str, float]]:
    """The same repetitions trained one at a time (final metrics per repetition)."""
    out = []
    for s in init_seeds:
        res = train_reps(gate, num_tasks, hparams, [s], data, shuffle_seed=shuffle_seed)
        assert isinstance(res, dict)
        out.extend(res[int(hparams["epochs"])])
    return out
