"""The initialisation seeds of the studies' runs: one derivation, :func:`derive_seed`.

A run's seed is ``(base · 1_000_003 + Σ weight · part) mod 2³¹`` over the study's ``(weight,
part)`` terms; a text part (a gate's name) counts as the sum of its code points. Each study
states its terms beside its seed function (synthetic: T, repetition and gate; recovery and the
selection study: the repetition only, so every variant and learning rate of a repetition is
paired), and the seeds it derives are stable: they do not depend on sweep order or batching.

The real-data studies (MovieLens, Multi-MNIST) derive theirs from a text key instead
(:func:`dselectk_research.realdata.spec.init_seed`): the little-endian integer of
``"base|gate|setting|rep|phase"`` modulo 2³¹ − 1 is no weighted sum of the parts modulo 2³¹,
and changing it would change every seed those records carry.
"""

from __future__ import annotations

#: the multiplier of the base seed and the modulus of every derived seed
BASE_WEIGHT, MODULUS = 1_000_003, 2**31


def derive_seed(base: int, *terms: tuple[int, int | str]) -> int:
    """``(base · 1_000_003 + Σ weight · part) mod 2³¹`` over ``terms`` of ``(weight, part)``;
    a ``str`` part counts as the sum of its characters' code points.

    Raises:
        TypeError: a term is not a pair of an int weight and an int or str part.
    """
    total = int(base) * BASE_WEIGHT
    for term in terms:
        if not (isinstance(term, tuple) and len(term) == 2):
            raise TypeError(f"derive_seed: a term must be a (weight, part) pair, got {term!r}")
        weight, part = term
        if isinstance(weight, bool) or not isinstance(weight, int):
            raise TypeError(f"derive_seed: a term's weight must be an int, got {weight!r}")
        if isinstance(part, str):
            value = sum(map(ord, part))
        elif isinstance(part, int) and not isinstance(part, bool):
            value = part
        else:
            raise TypeError(f"derive_seed: a term's part must be an int or a str, got {part!r}")
        total += weight * value
    return total % MODULUS
