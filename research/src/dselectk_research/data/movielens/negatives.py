"""Negative sampling: the implicit-feedback (watched / not watched) construction.

:func:`sample_negatives` draws, for each user, unrated movies uniformly as the negatives of
task 1 (*watch*) of the two-task dataset.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from dselectk_research.data.movielens.schema import IntArray


def sample_negatives(
    users: npt.ArrayLike,
    items: npt.ArrayLike,
    num_items: int,
    neg_ratio: int = 1,
    seed: int | np.random.SeedSequence | np.random.Generator = 0,
) -> tuple[IntArray, IntArray]:
    """Sample unrated (user, item) pairs uniformly, ``neg_ratio`` per rated pair of each user.

    For every user ``u`` with ``n_u`` distinct rated items, ``neg_ratio * n_u`` negatives are
    drawn independently and uniformly from the items ``u`` has not rated (so the same negative
    pair can occur more than once: with ``neg_ratio=1`` heavy ML-1M users have more ratings
    than unrated movies). Users who rated every item get no negatives. Sampling is vectorised
    rejection sampling, with an exact per-user fallback for the few draws still rejected after
    many rounds.

    Args:
        users: Dense user indices of the rated pairs, shape ``(N,)``, values ``>= 0``.
        items: Dense item indices of the rated pairs, shape ``(N,)``, in ``[0, num_items)``.
        num_items: Size of the item universe.
        neg_ratio: Negatives per rated pair (``>= 0``).
        seed: Seed, SeedSequence or Generator.

    Returns:
        ``(neg_users, neg_items)``, int64 arrays sorted by user, none of which is a rated pair.

    Raises:
        TypeError: If ``num_items`` or ``neg_ratio`` is not an int.
        ValueError: On mismatched shapes or out-of-range indices.
    """
    u = np.asarray(users, dtype=np.int64)
    it = np.asarray(items, dtype=np.int64)
    for name, val in (("num_items", num_items), ("neg_ratio", neg_ratio)):
        if isinstance(val, bool) or not isinstance(val, int | np.integer):
            raise TypeError(f"{name} must be an int, got {type(val).__name__}")
    if neg_ratio < 0:
        raise ValueError(f"neg_ratio must be >= 0, got {neg_ratio}")
    if num_items < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items}")
    if u.shape != it.shape or u.ndim != 1:
        raise ValueError(f"users and items must be 1-D of equal length, got {u.shape}, {it.shape}")
    if u.size and (u.min() < 0 or it.min() < 0 or it.max() >= num_items):
        raise ValueError("users must be >= 0 and items must be in [0, num_items)")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    keys = np.unique(u * num_items + it)
    num_users = int(u.max()) + 1 if u.size else 0
    n_pos = np.bincount(keys // num_items, minlength=num_users)
    want = n_pos * neg_ratio
    want[n_pos >= num_items] = 0
    neg_u = np.repeat(np.arange(num_users, dtype=np.int64), want)
    neg_i = np.empty_like(neg_u)
    pending = np.arange(neg_u.size)
    for _ in range(64):
        if pending.size == 0:
            break
        cand = rng.integers(0, num_items, size=pending.size)
        ck = neg_u[pending] * num_items + cand
        pos = np.searchsorted(keys, ck)
        hit = keys[np.minimum(pos, keys.size - 1)] == ck
        neg_i[pending[~hit]] = cand[~hit]
        pending = pending[hit]
    if pending.size:
        # Exact fallback for users who rated almost everything.
        for user in np.unique(neg_u[pending]):
            rows = pending[neg_u[pending] == user]
            rated = keys[(keys // num_items) == user] % num_items
            free = np.setdiff1d(np.arange(num_items), rated, assume_unique=True)
            neg_i[rows] = free[rng.integers(0, free.size, size=rows.size)]
    return neg_u, neg_i
