"""``swap_search(adopt=True)``: a gate of a bank may take another gate's whole selection.

Properties: the default (``adopt=False``) is the search as it was; adoption reaches a set that
single swaps cannot (two selectors at once), takes only final, distinct donor selections, keeps
the selectors already on a donor expert in place, and never raises a gate's loss.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from dselectk.gates import DSelectK, TopKGate
from dselectk.gates.base import Gate
from dselectk.layers import StackedMLP
from dselectk.models import MultiGateMoE
from dselectk.search import SwapSearch, _aligned, swap_search
from dselectk.training import TaskData, TrainConfig, train


def _put(gate: DSelectK, codes: list[list[int]], magnitude: float = 1.0) -> None:
    """Selector i of gate g on expert ``codes[g][i]``: Z written to ±magnitude·γ per bit."""
    with torch.no_grad():
        for g, row in enumerate(codes):
            for i, c in enumerate(row):
                bits = torch.tensor([(c >> j) & 1 for j in range(gate.num_bits)]).float()
                gate.z[g, i] = (bits * 2 - 1) * magnitude * gate.gamma


def _table_loss(gate: Gate, table: Callable[[frozenset[int]], float]) -> Callable[[], Tensor]:
    """A per-gate loss that depends only on each gate's selected set."""

    def loss() -> Tensor:
        sets = [frozenset(row) for row in gate.selection().tolist()]
        return torch.tensor([table(s) for s in sets])

    return loss


def _random_table(n: int, seed: int) -> dict[frozenset[int], float]:
    g = torch.Generator().manual_seed(seed)
    subsets = [frozenset(s) for r in (1, 2, 3) for s in itertools.combinations(range(n), r)]
    return {s: float(v) for s, v in zip(subsets, torch.rand(len(subsets), generator=g))}


def test_aligned_keeps_the_selectors_already_on_a_donor_expert() -> None:
    assert _aligned([1, 2], [2, 7]) == [7, 2]
    assert _aligned([9, 4], [3, 4]) == [3, 4]  # a code >= n (no expert) is replaced
    assert _aligned([5, 5], [5, 3]) == [5, 3]  # collided selectors: the first keeps it
    assert _aligned([0, 1, 2], [2, 5, 0]) == [0, 5, 2]
    assert _aligned([6, 4], [4, 6]) == [6, 4]


@pytest.mark.parametrize("seed", range(6))
def test_default_is_the_search_without_adopt(seed: int) -> None:
    """``adopt=False`` (the default) moves, scores and counts exactly as a call without it."""
    torch.manual_seed(seed)
    table = _random_table(8, seed)
    runs = []
    start = DSelectK(8, 2, gamma=1.0, num_gates=5)
    with torch.no_grad():
        start.z.copy_(torch.randn_like(start.z))  # fractional selectors
    for kwargs in ({}, {"adopt": False}):
        gate = DSelectK(8, 2, gamma=1.0, num_gates=5)
        gate.load_state_dict(start.state_dict())
        res = swap_search(gate, _table_loss(gate, lambda s: table[s]), sweeps=3, **kwargs)
        runs.append((gate.logits.detach().clone(), res))
    (a, ra), (b, rb) = runs
    assert torch.equal(a, b)
    assert torch.equal(ra.moves, rb.moves) and torch.equal(ra.loss_after, rb.loss_after)
    assert (ra.evaluations, ra.sweeps) == (rb.evaluations, rb.sweeps)


def _two_swaps_away(gate: Gate) -> Callable[[], Tensor]:
    """Loss 0 on {0, 1}, 1 on any other set: from {4, 5} no single swap lowers it."""
    return _table_loss(gate, lambda s: 0.0 if s == frozenset({0, 1}) else 1.0)


def test_dselect_k_adopt_reaches_a_set_that_single_swaps_cannot() -> None:
    gate = DSelectK(8, 2, gamma=1.0, num_gates=3)
    _put(gate, [[0, 1], [4, 5], [5, 6]])
    alpha = gate.alpha.detach().clone()
    loss = _two_swaps_away(gate)
    res = swap_search(gate, loss)
    assert res.moves.tolist() == [0, 0, 0]
    assert gate.selection().tolist() == [[0, 1], [4, 5], [5, 6]]
    res = swap_search(gate, loss, adopt=True)
    assert [set(r) for r in gate.selection().tolist()] == [{0, 1}] * 3
    assert res.loss_after.tolist() == [0.0, 0.0, 0.0]
    assert res.moves.tolist() == [0, 1, 1]  # one adoption each
    assert gate.is_binary().all()
    assert torch.equal(gate.alpha.detach(), alpha)  # the shares are not touched
    # one sweep of k·n swaps (it moves nothing: the search stops), then one adoption round of
    # one evaluation per other gate
    assert res.sweeps == 1 and res.evaluations == 1 + 2 * 8 + 2


def test_topk_adopt_reaches_a_set_that_single_swaps_cannot() -> None:
    gate = TopKGate(8, 2, num_gates=2)
    with torch.no_grad():
        gate.logits.copy_(torch.tensor([[3.0, 2.0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 3, 2, 0, 0]]))
    loss = _two_swaps_away(gate)
    assert swap_search(gate, loss).moves.tolist() == [0, 0]
    res = swap_search(gate, loss, adopt=True)
    assert [set(r) for r in gate.selection().tolist()] == [{0, 1}, {0, 1}]
    assert res.moves.tolist() == [0, 1]


def test_adopt_keeps_the_selectors_already_on_a_donor_expert() -> None:
    """Gate 1 holds (5, 0, 6); the donor {0, 1, 2}, two swaps away: selector 1 keeps 0, the
    others take 1 and 2 in the donor's order."""
    gate = DSelectK(8, 3, gamma=1.0, num_gates=2)
    _put(gate, [[0, 1, 2], [5, 0, 6]])
    loss = _table_loss(gate, lambda s: 0.0 if s == frozenset({0, 1, 2}) else 1.0)
    assert swap_search(gate, loss, adopt=True).moves.tolist() == [0, 1]
    assert gate.selection().tolist() == [[0, 1, 2], [1, 0, 2]]


def test_adopt_skips_fractional_and_collided_donors() -> None:
    gate = DSelectK(8, 2, gamma=1.0, num_gates=3)
    _put(gate, [[0, 1], [4, 5], [2, 2]])
    with torch.no_grad():
        gate.z[0] *= 0.1  # gate 0's selectors are fractional: not a donor
    loss = _table_loss(gate, lambda s: {frozenset({0, 1}): 0.0, frozenset({2}): 0.5}.get(s, 1.0))
    before = gate.logits.detach().clone()
    res = swap_search(gate, loss, adopt=True, sweeps=1, tol=0.0)
    # gate 1 cannot take {0, 1} (fractional) nor {2} (collided: one expert, not k distinct)
    assert res.moves[1].item() == 0
    assert torch.equal(gate.logits.detach()[1], before[1])


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", ["dselect", "topk"])
def test_adopt_never_raises_a_loss(seed: int, kind: str) -> None:
    torch.manual_seed(seed)
    table = _random_table(8, seed)
    gate: Gate
    if kind == "dselect":
        gate = DSelectK(8, 2, gamma=1.0, num_gates=6)
        with torch.no_grad():
            gate.z.copy_(torch.randn_like(gate.z))
    else:
        gate = TopKGate(8, 2, num_gates=6)
        with torch.no_grad():
            gate.logits.copy_(torch.randn_like(gate.logits))
    loss = _table_loss(gate, lambda s: table[s])
    res = swap_search(gate, loss, adopt=True, sweeps=4)
    assert torch.all(res.loss_after <= res.loss_before)
    assert torch.equal(res.loss_after, loss())  # the reported loss is the gate's


@pytest.mark.parametrize("seed", range(8))
def test_adopt_slack_trades_at_most_that_much_loss_for_a_shared_selection(seed: int) -> None:
    torch.manual_seed(seed)
    table = _random_table(8, seed)
    gate = DSelectK(8, 2, gamma=1.0, num_gates=6)
    codes = [torch.randperm(8)[:2].tolist() for _ in range(6)]
    _put(gate, codes)
    loss = _table_loss(gate, lambda s: table[s])
    before = [frozenset(r) for r in gate.selection().tolist()]
    res = swap_search(gate, loss, sweeps=1, tol=1.0, adopt=True, adopt_slack=0.3)  # no swaps
    after = [frozenset(r) for r in gate.selection().tolist()]
    assert torch.all(res.loss_after <= res.loss_before * 1.3 + 1e-7)
    assert torch.equal(res.loss_after, loss())
    for g in range(6):
        if res.moves[g]:
            # it took a selection that another gate holds after the round, and held before it
            assert after[g] != before[g] and after[g] in before
            assert any(after[h] == after[g] for h in range(6) if h != g)
        else:
            assert after[g] == before[g]


def test_adopt_slack_never_lets_two_gates_exchange_selections() -> None:
    """Each gate is 1 % worse on the other's set: with slack, only the cheaper one takes it."""
    gate = DSelectK(8, 2, gamma=1.0, num_gates=2)
    _put(gate, [[0, 1], [2, 3]])
    table = {frozenset({0, 1}): [1.0, 1.02], frozenset({2, 3}): [1.01, 1.0]}

    def loss() -> Tensor:
        sets = [frozenset(r) for r in gate.selection().tolist()]
        return torch.tensor([table.get(s, [9.0, 9.0])[g] for g, s in enumerate(sets)])

    assert swap_search(gate, loss, adopt=True).moves.tolist() == [0, 0]  # no slack: no move
    res = swap_search(gate, loss, adopt=True, adopt_slack=0.05)
    assert res.moves.tolist() == [1, 0]  # gate 0's change (+1 %) is cheaper than gate 1's (+2 %)
    assert [set(r) for r in gate.selection().tolist()] == [{2, 3}, {2, 3}]
    assert res.loss_after.tolist() == pytest.approx([1.01, 1.0])
    with pytest.raises(ValueError, match="adopt_slack"):
        swap_search(gate, loss, adopt=True, adopt_slack=-0.1)


def test_swap_search_callback_passes_adopt() -> None:
    gate = DSelectK(8, 2, gamma=1.0, num_gates=2)
    _put(gate, [[0, 1], [4, 5]])
    loss = _two_swaps_away(gate)
    data = TaskData(torch.randn(8, 3), [torch.randn(8, 1), torch.randn(8, 1)])
    model = MultiGateMoE(StackedMLP(8, 3, [1]), gate)  # binary S(Z): no gradient moves it
    for adopt, expected in ((False, {4, 5}), (True, {0, 1})):
        _put(gate, [[0, 1], [4, 5]])
        cb = SwapSearch(gate, loss, at=[1], adopt=adopt)
        train(
            model, data, "mse", TrainConfig(epochs=1, batch_size=8, progress=False), callbacks=[cb]
        )
        assert set(gate.selection()[1].tolist()) == expected
        assert cb.results[0].moves.tolist() == [0, int(adopt)]
