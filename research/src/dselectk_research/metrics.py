"""Expert-selection metrics of Appendix C.1 ("Measuring Expert Selection Performance").

The Jaccard index of two selected expert sets A, B is |A ∩ B| / |A ∪ B|. The paper averages it
over all pairs of *related* tasks (same group) and over all pairs of *unrelated* tasks (different
groups). The reference line of Figure C.1 is a random gate that picks k experts uniformly at
random; its expected Jaccard index is computed here in closed form (hypergeometric overlap)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def jaccard_matrix(selected: Tensor) -> Tensor:
    """Jaccard index of every pair of rows of a boolean selection mask: (..., T, n) bool
    (whether task t selects expert i) → (..., T, T) float64 (1.0 where both sets are empty)."""
    s = selected.to(torch.float64)
    inter = s @ s.transpose(-1, -2)
    size = s.sum(-1)
    union = size.unsqueeze(-1) + size.unsqueeze(-2) - inter
    return torch.where(union > 0, inter / union.clamp_min(1.0), torch.ones_like(inter))


def pairwise_jaccard(selected: Tensor, groups: Tensor | Sequence[int]) -> tuple[Tensor, Tensor]:
    """Average Jaccard index over related pairs and over unrelated pairs (Appendix C.1) of
    (..., T, n) bool selection masks, tasks grouped by ``groups`` (T,): (related, unrelated),
    each (...,), the means over pairs t < u in the same group, resp. in different groups; NaN
    where there is no such pair (e.g. unrelated pairs with a single group)."""
    g = torch.as_tensor(groups)
    t = g.shape[0]
    if selected.shape[-2] != t:
        raise ValueError(f"selected has {selected.shape[-2]} tasks but groups has {t}")
    jm = jaccard_matrix(selected)
    upper = torch.ones(t, t, dtype=torch.bool).triu(1)
    same = g.unsqueeze(0) == g.unsqueeze(1)
    # the mean over the pairs of each mask: 0 / 0 = NaN where there is none
    related, unrelated = ((jm * m).sum((-1, -2)) / m.sum() for m in (upper & same, upper & ~same))
    return related, unrelated


def expected_random_jaccard(num_experts: int, k: int) -> float:
    """E[J(A, B)] for two independent uniformly random k-subsets of n experts (the random gate
    of Figure C.1): |A ∩ B| is hypergeometric, P(j) = C(k, j) C(n - k, k - j) / C(n, k), and
    J = j / (2k - j)."""
    if not 1 <= k <= num_experts:
        raise ValueError(f"need 1 <= k <= num_experts, got k={k}, n={num_experts}")
    total = math.comb(num_experts, k)
    return sum(
        math.comb(k, j) * math.comb(num_experts - k, k - j) / total * j / (2 * k - j)
        for j in range(0, k + 1)
    )


def distinct_experts(selected: Tensor) -> Tensor:
    """Number of distinct experts each task selects: (..., T, n) bool → (..., T) int (experts,
    not selectors: DSelect-k's selectors can land on the same expert)."""
    return selected.sum(-1)


def recovered_experts(weights: Tensor, true_experts: Tensor, k: int) -> Tensor:
    """How many of the true experts (a (..., n) bool mask) a gate's (..., n) ``weights``
    select (Appendix C.2.2): (...,) counts in [0, k]. The selected set is the experts with a
    nonzero weight, of the k largest weights only, so a (non-converged) gate cannot score by
    spreading weight over everything."""
    top = weights.topk(k, dim=-1).indices
    mask = torch.zeros_like(weights, dtype=torch.bool).scatter(-1, top, True) & (weights > 0)
    return (mask & true_experts).sum(-1)
