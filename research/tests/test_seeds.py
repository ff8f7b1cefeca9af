"""One seed derivation: every study's init seeds come from dselectk_research.seeds.derive_seed
and are the seeds their records always carried."""

from __future__ import annotations

import itertools

import pytest

from dselectk_research.recovery import init_seed as recovery_seed
from dselectk_research.seeds import derive_seed
from dselectk_research.selection.study import STUDY_SEED
from dselectk_research.selection.study import init_seed as selection_seed
from dselectk_research.synthetic.spec import init_seed as synthetic_seed


def test_derive_seed_is_the_weighted_sum_modulo_2_31() -> None:
    assert derive_seed(0) == 0
    assert derive_seed(1) == 1_000_003
    assert derive_seed(2, (3, 5), (1, "ab")) == (2 * 1_000_003 + 15 + 97 + 98)
    assert derive_seed(10**9, (7, 10**9)) == (10**9 * 1_000_003 + 7 * 10**9) % 2**31
    assert 0 <= derive_seed(-5, (1, -7)) < 2**31


@pytest.mark.parametrize(
    ("seed", "gate", "t", "rep"),
    list(itertools.product([0, 1, 1234, 2**31 - 1], ["dselect_k", "topk"], [16, 128], [0, 7])),
)
def test_the_studies_keep_their_seeds(seed: int, gate: str, t: int, rep: int) -> None:
    # the formulas the records were written with
    old_synthetic = (seed * 1_000_003 + t * 10_007 + rep * 101 + sum(map(ord, gate))) % 2**31
    old_recovery = (seed * 1_000_003 + rep * 7919 + 17) % 2**31
    assert synthetic_seed(seed, gate, t, rep) == old_synthetic
    assert recovery_seed(seed, rep) == old_recovery
    assert selection_seed(rep) == (STUDY_SEED * 1_000_003 + rep * 7919 + 17) % 2**31


@pytest.mark.parametrize("terms", [(5,), ((1, 2, 3),), ((1.5, 2),), ((1, 2.0),), ((True, 1),)])
def test_bad_terms_are_refused(terms: tuple) -> None:
    with pytest.raises(TypeError, match="derive_seed"):
        derive_seed(0, *terms)
