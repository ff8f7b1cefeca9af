"""Jaccard metrics of Appendix C.1 against hand-computed values."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch

from dselectk_research.metrics import (
    distinct_experts,
    expected_random_jaccard,
    jaccard_matrix,
    pairwise_jaccard,
    recovered_experts,
)


def jaccard(a: set[int] | Sequence[int], b: set[int] | Sequence[int]) -> float:
    """|A ∩ B| / |A ∪ B| of two expert sets (1.0 when both are empty): the reference the
    vectorised metrics are checked against."""
    sa, sb = set(a), set(b)
    union = sa | sb
    if not union:
        return 1.0
    return len(sa & sb) / len(union)


def _mask(sets: list[set[int]], n: int) -> torch.Tensor:
    m = torch.zeros(len(sets), n, dtype=torch.bool)
    for i, s in enumerate(sets):
        m[i, list(s)] = True
    return m


def test_jaccard_by_hand() -> None:
    assert jaccard({0, 1, 2, 3}, {2, 3, 4, 5}) == pytest.approx(2 / 6)
    assert jaccard({0, 1}, {0, 1}) == 1.0
    assert jaccard({0}, {1}) == 0.0
    assert jaccard(set(), set()) == 1.0


def test_pairwise_related_unrelated_by_hand() -> None:
    # Tasks 0, 1 in group 0; tasks 2, 3 in group 1; 8 experts.
    sets = [{0, 1, 2, 3}, {0, 1, 2, 4}, {4, 5, 6, 7}, {0, 5, 6, 7}]
    sel = _mask(sets, 8)
    rel, unrel = pairwise_jaccard(sel, [0, 0, 1, 1])
    # related: J(0,1) = 3/5, J(2,3) = 3/5
    assert float(rel) == pytest.approx(0.6)
    # unrelated: J(0,2)=0, J(0,3)=1/7, J(1,2)=1/7, J(1,3)=1/7
    assert float(unrel) == pytest.approx((0 + 1 / 7 + 1 / 7 + 1 / 7) / 4)
    jm = jaccard_matrix(sel)
    for i in range(4):
        for j in range(4):
            assert float(jm[i, j]) == pytest.approx(jaccard(sets[i], sets[j]))


def test_pairwise_batched_and_single_group() -> None:
    sel = _mask([{0, 1}, {0, 2}], 4).unsqueeze(0).expand(3, -1, -1)
    rel, unrel = pairwise_jaccard(sel, [0, 0])
    assert rel.shape == (3,) and torch.allclose(rel, torch.full((3,), 1 / 3, dtype=rel.dtype))
    assert torch.isnan(unrel).all()  # a single group has no unrelated pairs


def test_expected_random_jaccard_by_hand() -> None:
    assert expected_random_jaccard(4, 4) == 1.0
    # n = 8, k = 4: P(j) = C(4,j) C(4,4-j) / 70 and J = j / (8 - j)
    by_hand = (16 / 70) * (1 / 7) + (36 / 70) * (2 / 6) + (16 / 70) * (3 / 5) + 1 / 70
    assert expected_random_jaccard(8, 4) == pytest.approx(by_hand)
    with pytest.raises(ValueError):
        expected_random_jaccard(3, 4)


@pytest.mark.parametrize("n", [8, 16, 32])
def test_expected_random_jaccard_monte_carlo(n: int) -> None:
    rng = random.Random(0)
    draws = 20_000
    total = sum(jaccard(rng.sample(range(n), 4), rng.sample(range(n), 4)) for _ in range(draws))
    # standard error of the mean is below 0.003 for these n
    assert total / draws == pytest.approx(expected_random_jaccard(n, 4), abs=0.01)


def test_distinct_and_recovered() -> None:
    sel = _mask([{0, 1}, {1, 2, 3}], 4)
    assert distinct_experts(sel).tolist() == [2, 3]
    w = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    true = torch.tensor([[True, False, True, False], [True, True, True, True]])
    assert recovered_experts(w, true, 2).tolist() == [1, 2]
    assert not math.isnan(float(recovered_experts(w, true, 4)[0]))
