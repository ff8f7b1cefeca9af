"""The one rule by which every study picks its best hyperparameter configuration.

Each candidate configuration comes with its validation values, one per repetition (or tuning
trial). The rule (:func:`best_configuration`, worded by :data:`RULE`):

1. a candidate with a missing or non-finite value (a diverged run) is ineligible, and so is one
   its study declares ineligible (``eligible``); the means of the others are the plain means
   of their values;
2. where the study states a preference (``prefer``, e.g. binary selections first) and some
   eligible candidate meets it, only those compete;
3. the lowest mean wins (the highest, for a metric to maximize such as accuracy); ties go to
   the earliest candidate in the order the study gives (each study states its order);
4. no eligible candidate: no choice (``key`` None); the study says what it does then.

Each study states its candidates, order and eligibility where it calls the rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["RULE", "Choice", "best_configuration"]

K = TypeVar("K")

#: the rule in words, for summaries and reports (a study adds its eligibility and order)
RULE = (
    "lowest mean validation value over the repetitions; a configuration with a diverged run "
    "is ineligible; ties go to the earliest configuration in the stated order"
)


@dataclass(frozen=True)
class Choice(Generic[K]):
    """What :func:`best_configuration` chose and from what.

    Attributes:
        key: the chosen candidate's key, or None when none was eligible.
        mean: its mean validation value (NaN when none was chosen).
        preferred: it meets the study's preference (True without one).
        means: every candidate's mean, in the given order (NaN: it has a diverged run).
        diverged: the keys of the candidates with a diverged run, in the given order.
        preferred_count: candidates meeting the preference (diverged ones included).
    """

    key: K | None
    mean: float
    preferred: bool
    means: tuple[float, ...]
    diverged: tuple[K, ...]
    preferred_count: int


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def best_configuration(
    candidates: Iterable[tuple[K, Sequence[Any]]],
    *,
    maximize: bool = False,
    eligible: Callable[[K], bool] | None = None,
    prefer: Callable[[K], bool] | None = None,
) -> Choice[K]:
    """The best of ``candidates`` ((key, validation values) pairs, in the study's order) by
    the rule of this module: diverged (a value missing or not finite) or not ``eligible``
    candidates out, the ``prefer``\\ red ones first when there are any, then the lowest mean
    (highest with ``maximize``), ties to the earliest.

    Raises:
        ValueError: a candidate without values, or a repeated key.
    """
    rows: list[tuple[K, float, bool, bool]] = []  # key, mean, eligible, preferred
    seen: set[Any] = set()
    diverged: list[K] = []
    for key, values in candidates:
        values = list(values)
        if not values:
            raise ValueError(f"best_configuration: candidate {key!r} has no values")
        marker = key if isinstance(key, Hashable) else repr(key)
        if marker in seen:
            raise ValueError(f"best_configuration: candidate {key!r} given twice")
        seen.add(marker)
        ok = all(_finite(v) for v in values)
        mean = sum(float(v) for v in values) / len(values) if ok else math.nan
        if not ok:
            diverged.append(key)
        good = ok and (eligible is None or bool(eligible(key)))
        rows.append((key, mean, good, prefer is None or bool(prefer(key))))
    pool = [r for r in rows if r[2]]
    pool = [r for r in pool if r[3]] or pool
    sign = -1.0 if maximize else 1.0
    best = None
    for r in pool:  # strict improvement only: the earliest of equal means stays
        if best is None or sign * r[1] < sign * best[1]:
            best = r
    return Choice(
        key=None if best is None else best[0],
        mean=math.nan if best is None else best[1],
        preferred=True if best is None else best[3],
        means=tuple(r[1] for r in rows),
        diverged=tuple(diverged),
        preferred_count=sum(1 for r in rows if r[3]),
    )
