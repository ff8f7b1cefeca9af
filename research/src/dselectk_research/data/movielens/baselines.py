"""Non-neural reference predictors of the two MovieLens tasks (what a model must beat).

* **constant**: task 1 predicts the training fraction of watched pairs for every pair; task 2
  the mean training rating;
* **popularity + biases**: task 1 predicts the movie's smoothed watch rate in the training split,
  ``p_i = (watched_i + m·p̄) / (n_i + m)`` (``p̄`` the overall rate, ``m`` the prior strength);
  task 2 predicts ``μ + b_u + b_i``, user and movie biases fitted to the training ratings by
  regularised least squares (alternating closed-form sweeps of
  ``b_i = Σ (r − μ − b_u) / (λ + n_i)`` and ``b_u = Σ (r − μ − b_i) / (λ + n_u)``). ``m`` and ``λ``
  are chosen on the validation split.

Task 1 is scored by the mean binary cross-entropy, task 2 by the squared rating error of the
rated pairs averaged over *all* pairs (negatives weight 0; Keras ``sample_weight`` semantics).
The splits are :class:`~dselectk_research.data.movielens.MovieLensSplit` (side features unused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dselectk_research.data.movielens.dataset import MovieLensSplit

__all__ = [
    "PRIORS",
    "REGS",
    "bce",
    "fit_biases",
    "item_popularity",
    "masked_mse",
    "reference_metrics",
]

#: prior strengths m of the popularity predictor tried on the validation split
PRIORS = (1.0, 10.0, 100.0)
#: regularisation λ of the biases tried on the validation split
REGS = (1.0, 5.0, 10.0, 25.0, 50.0)
_EPS = 1e-7  # probabilities are clipped to [ε, 1 − ε] (Keras' clipping of BCE)


def bce(p: Tensor, y: Tensor) -> float:
    """Mean binary cross-entropy of probabilities ``p`` for 0/1 labels ``y``."""
    p = p.double().clamp(_EPS, 1 - _EPS)
    y = y.double()
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def masked_mse(pred: Tensor, rating: Tensor, mask: Tensor) -> float:
    """Σ mask·(pred − rating)² / N: the task-2 loss of the MovieLens models."""
    err = pred.double() - rating.double()
    return float((err.square() * mask.double()).mean())


def item_popularity(items: Tensor, watched: Tensor, num_items: int, prior: float) -> Tensor:
    """Smoothed watch rate of each movie: ``(Σ watched + prior·p̄) / (count + prior)``."""
    y = watched.double()
    rate = float(y.mean())
    pos = torch.zeros(num_items, dtype=torch.float64).index_add_(0, items, y)
    cnt = torch.zeros(num_items, dtype=torch.float64).index_add_(0, items, torch.ones_like(y))
    return (pos + prior * rate) / (cnt + prior)


def fit_biases(
    users: Tensor,
    items: Tensor,
    ratings: Tensor,
    num_users: int,
    num_items: int,
    reg: float,
    sweeps: int = 10,
) -> tuple[float, Tensor, Tensor]:
    """μ, b_u, b_i minimising ``Σ (r − μ − b_u − b_i)² + λ (Σ b_u² + Σ b_i²)`` (μ the mean
    rating) by alternating closed-form sweeps (movie biases first)."""
    r = ratings.double()
    mu = float(r.mean())
    n_u = torch.zeros(num_users, dtype=torch.float64).index_add_(0, users, torch.ones_like(r))
    n_i = torch.zeros(num_items, dtype=torch.float64).index_add_(0, items, torch.ones_like(r))
    bu = torch.zeros(num_users, dtype=torch.float64)
    bi = torch.zeros(num_items, dtype=torch.float64)
    for _ in range(sweeps):
        res = torch.zeros(num_items, dtype=torch.float64).index_add_(0, items, r - mu - bu[users])
        bi = res / (reg + n_i)
        res = torch.zeros(num_users, dtype=torch.float64).index_add_(0, users, r - mu - bi[items])
        bu = res / (reg + n_u)
    return mu, bu, bi


def _metrics(p: Tensor, pred: Tensor, d: MovieLensSplit) -> dict[str, float]:
    return {
        "loss_task1": bce(p, d.watched),
        "loss_task2": masked_mse(pred, d.rating, d.rating_mask),
        "accuracy_task1": float(((p > 0.5).double() == d.watched.double()).double().mean()),
    }


def reference_metrics(
    train: MovieLensSplit,
    val: MovieLensSplit,
    test: MovieLensSplit,
    num_users: int,
    num_items: int,
    *,
    priors: Sequence[float] = PRIORS,
    regs: Sequence[float] = REGS,
) -> dict[str, Any]:
    """Test (and validation) task losses and task-1 accuracy of the two reference predictors.

    Returns:
        ``{"constant": {split: metrics}, "popularity_biases": {split: metrics, "prior": m,
        "reg": λ}}`` with metrics ``loss_task1`` (BCE), ``loss_task2`` (masked MSE) and
        ``accuracy_task1`` for ``split`` in ("val", "test").
    """
    u, i, w, r = train.user, train.item, train.watched, train.rating
    rated = train.rating_mask > 0.5
    rate, mu = float(w.double().mean()), float(r[rated].double().mean())
    out: dict[str, Any] = {"constant": {}, "popularity_biases": {}}
    for name, d in (("val", val), ("test", test)):
        n = len(d)
        out["constant"][name] = _metrics(
            torch.full((n,), rate, dtype=torch.float64),
            torch.full((n,), mu, dtype=torch.float64),
            d,
        )
    vu, vi, vw, vr, vm = val.user, val.item, val.watched, val.rating, val.rating_mask
    pops = {m: item_popularity(i, w, num_items, m) for m in priors}
    prior = min(priors, key=lambda m: bce(pops[m][vi], vw))
    fits = {
        lam: fit_biases(u[rated], i[rated], r[rated], num_users, num_items, lam) for lam in regs
    }

    def predict(fit: tuple[float, Tensor, Tensor], uu: Tensor, ii: Tensor) -> Tensor:
        return fit[0] + fit[1][uu] + fit[2][ii]

    reg = min(regs, key=lambda lam: masked_mse(predict(fits[lam], vu, vi), vr, vm))
    best = out["popularity_biases"]
    best.update(prior=prior, reg=reg)
    for name, d in (("val", val), ("test", test)):
        best[name] = _metrics(pops[prior][d.item], predict(fits[reg], d.user, d.item), d)
    return out
