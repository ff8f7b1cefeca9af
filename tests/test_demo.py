"""``dselectk demo``: its sharing summary is computed from the selections it prints; it trains on
one thread."""

from __future__ import annotations

import math
import re

import pytest
import torch

from dselectk import members
from dselectk.cli import main
from dselectk.demo import make_data, sharing


def test_sharing_counts_identical_and_overlapping_pairs() -> None:
    # groups: (0, 1) identical, (2, 3) overlap in 2 only, (4, 5) disjoint
    s = sharing([{0, 1}, {1, 0}, {2, 3}, {2, 4}, {5, 6}, {7, 0}])
    assert (s.identical, s.overlapping, s.pairs) == (1, 2, 3)
    assert not s.every_group_identical and not s.every_group_overlaps
    assert s.jaccard_within == pytest.approx((1.0 + 1 / 3 + 0.0) / 3)
    # across groups, 12 pairs: only {0, 1} vs {7, 0} (twice) overlap, Jaccard 1/3 each
    assert s.jaccard_across == pytest.approx((2 / 3) / 12)
    assert sharing([{0, 1}, {0, 1}, {3, 2}, {2, 3}]).every_group_identical
    s = sharing([{0, 1}, {0, 2}, {3, 2}, {2, 3}])
    assert s.every_group_overlaps and not s.every_group_identical


def test_sharing_without_pairs() -> None:
    s = sharing([{0, 1}])  # one task: no same-group pair
    assert s.pairs == 0 and not s.every_group_identical and not s.every_group_overlaps
    assert math.isnan(s.jaccard_within)
    s = sharing([{0, 1}, {0, 1}, {4, 5}])  # the odd last task has no partner
    assert (s.identical, s.pairs) == (1, 1) and s.every_group_identical


def test_make_data_mixes_each_groups_own_two_experts() -> None:
    train, test, true_sets = make_data(8, 200, seed=3)
    assert true_sets == [{0, 1}, {0, 1}, {2, 3}, {2, 3}, {4, 5}, {4, 5}, {6, 7}, {6, 7}]
    assert train.x.shape == (160, 10) and test.x.shape == (40, 10)
    assert len(train.ys) == 8 and train.ys[0].shape == (160, 1)


def test_printed_sharing_is_computed_from_the_printed_selections(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The observed line and the verdict agree with the table of selections the demo printed."""
    args = ["demo", "--tasks", "4", "--examples", "800", "--epochs", "2", "--no-progress"]
    assert main([*args, "--seed", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(
        r"^\s*(\d+)\s+(\d+)\s+((?:\d+ \(\d\.\d\d\)(?:, )?)+)\s+(True|False)$", out, re.M
    )
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    assert [int(r[1]) for r in rows] == [0, 0, 1, 1]
    selected = [{int(e) for e in re.findall(r"(\d+) \(", r[2])} for r in rows]
    s = sharing(selected)
    assert (
        f"observed: {s.identical} of 2 same-group task pairs selected identical expert sets; "
        f"{s.overlapping} of 2 same-group task pairs share an expert; "
        f"mean Jaccard of selections {s.jaccard_within:.2f} within groups, "
        f"{s.jaccard_across:.2f} across groups" in out
    )
    same = "yes" if s.identical == 2 else "no"
    overlap = "yes" if s.overlapping == 2 else "no"
    assert f"in every group, the two tasks share an expert: {overlap}\n" in out
    assert f"in every group, the two tasks selected the same experts: {same}\n" in out


def test_the_demo_trains_on_one_thread_and_restores_the_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    real_train = members.train

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        return real_train(*args, **kwargs)  # type: ignore[arg-type]

    torch.set_num_threads(2)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(members, "train", spy)
            args = ["demo", "--tasks", "2", "--examples", "200", "--epochs", "1", "--no-progress"]
            assert main(args) == 0
        assert seen == [1] and torch.get_num_threads() == 2  # one thread inside, then restored
    finally:
        torch.set_num_threads(before)
    assert "on one thread" in capsys.readouterr().out


def test_the_demo_keeps_the_restart_with_the_lowest_validation_mse(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Restarts train side by side; the one kept (whose selections are printed) is the one with
    the lowest validation MSE, and its line says so."""
    args = ["demo", "--tasks", "4", "--examples", "800", "--epochs", "2", "--no-progress"]
    assert main([*args, "--restarts", "3", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    lines = re.findall(r"^restart (\d+): validation MSE ([0-9.]+);.*?(  <- kept)?$", out, re.M)
    assert [int(r) for r, _, _ in lines] == [0, 1, 2]
    kept = [int(r) for r, _, mark in lines if mark]
    assert len(kept) == 1 and kept[0] == min(range(3), key=lambda i: float(lines[i][1]))
    assert main([*args, "--restarts", "1", "--seed", "2"]) == 0
    assert "restart 0:" not in capsys.readouterr().out  # one restart: nothing to choose
