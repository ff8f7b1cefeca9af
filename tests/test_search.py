"""Swap local search (dselectk.search): finds the right experts where gradients cannot move."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dselectk.gates import DSelectK, SoftmaxGate, TopKGate
from dselectk.search import SwapSearch, swap_search
from dselectk.training import TaskData, TrainConfig, train


def _collapsed(gate: DSelectK, code: int = 0) -> None:
    """Every selector of every gate binary on expert ``code``."""
    with torch.no_grad():
        z = gate.z
        bits = torch.tensor([(code >> j) & 1 for j in range(gate.num_bits)]).float() * 2 - 1
        z.copy_(bits * gate.gamma)


def _targets(groups: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(groups)])


@pytest.mark.parametrize("n", [8, 11, 16])
def test_dselect_k_search_recovers_the_target_set_from_a_collapse(n: int) -> None:
    torch.manual_seed(0)
    groups, k = 5, 3
    gate = DSelectK(n, k, gamma=2.0, num_gates=groups)
    _collapsed(gate)
    true = _targets(groups, n, k)
    target = torch.zeros(groups, n).scatter_(1, true, 1.0 / k)

    def loss() -> torch.Tensor:
        w = gate.expert_weights()
        return ((w - target) ** 2).sum(-1)

    with torch.no_grad():
        gate.alpha.zero_()  # equal shares: the target is reachable exactly
    res = swap_search(gate, loss, sweeps=3)
    assert torch.all(res.loss_after <= res.loss_before)
    assert torch.allclose(res.loss_after, torch.zeros(groups), atol=1e-10)
    assert gate.is_binary().all()
    for g in range(groups):
        assert set(gate.selected_experts()[g].nonzero().flatten().tolist()) == set(true[g].tolist())
    # one move per selector, except when expert 0 (where all collapsed) is a target: one stays
    assert res.moves.tolist() == [k - int(0 in true[g].tolist()) for g in range(groups)]
    assert res.sweeps == 2  # the second sweep finds nothing
    assert res.evaluations == 1 + res.sweeps * k * n


def test_dselect_k_search_never_creates_a_collision() -> None:
    torch.manual_seed(1)
    gate = DSelectK(8, 3, gamma=1.0, num_gates=4)
    # selectors on distinct experts 0, 1, 2; a loss that loves expert 0 only
    with torch.no_grad():
        for i, c in enumerate([0, 1, 2]):
            gate.z[:, i] = (torch.tensor([(c >> j) & 1 for j in range(3)]).float() * 2 - 1) * 1.0

    def loss() -> torch.Tensor:
        return -gate.expert_weights()[:, 0]

    swap_search(gate, loss)
    codes = gate.bits().round().long()
    code = (codes << torch.arange(3)).sum(-1)  # (G, K)
    for g in range(4):
        assert len(set(code[g].tolist())) == 3


def test_search_keeps_an_optimum_and_never_raises_the_loss() -> None:
    torch.manual_seed(2)
    gate = DSelectK(8, 2, gamma=1.0, num_gates=3)
    with torch.no_grad():
        gate.z.copy_(torch.randn_like(gate.z))  # fractional selectors
    w0 = gate.expert_weights().clone()

    def loss() -> torch.Tensor:
        return ((gate.expert_weights() - w0) ** 2).sum(-1)  # current point is optimal

    before = gate.logits.detach().clone()
    res = swap_search(gate, loss)
    assert res.moves.tolist() == [0, 0, 0]
    assert res.sweeps == 1
    assert torch.equal(gate.logits.detach(), before)


def test_topk_search_swaps_in_the_right_experts() -> None:
    torch.manual_seed(3)
    groups, n, k = 6, 10, 3
    gate = TopKGate(n, k, num_gates=groups)
    true = _targets(groups, n, k, seed=4)

    def loss() -> torch.Tensor:
        w = gate.expert_weights()
        return -w.gather(1, true).sum(-1)

    res = swap_search(gate, loss)
    assert torch.allclose(res.loss_after, -torch.ones(groups))
    sel = gate.selected_experts()
    for g in range(groups):
        assert set(sel[g].nonzero().flatten().tolist()) == set(true[g].tolist())
    # the weights keep their values (a swap exchanges two logits)
    assert torch.allclose(
        gate.expert_weights().sort(-1).values[:, -k:],
        torch.softmax(gate.logits.detach().topk(k).values, -1).sort(-1).values,
    )


def test_search_rejects_what_it_cannot_search() -> None:
    with pytest.raises(ValueError, match="static gate"):
        swap_search(DSelectK(8, 2, in_features=3), lambda: torch.zeros(()))
    with pytest.raises(TypeError, match="DSelectK and TopKGate"):
        swap_search(SoftmaxGate(8), lambda: torch.zeros(()))
    gate = DSelectK(8, 2, num_gates=3)
    with pytest.raises(ValueError, match=r"one loss per gate of the bank \(3\)"):
        swap_search(gate, lambda: torch.zeros(2))
    with pytest.raises(ValueError, match="non-finite"):
        swap_search(gate, lambda: torch.full((3,), float("nan")))
    with pytest.raises(ValueError, match="sweeps"):
        swap_search(gate, lambda: torch.zeros(3), sweeps=0)
    with pytest.raises(ValueError, match="scale"):
        swap_search(gate, lambda: torch.zeros(3), scale=0.4)
    with pytest.raises(ValueError, match="at: steps"):
        SwapSearch(gate, lambda: torch.zeros(3), at=[0])


def test_swap_search_callback_runs_inside_train() -> None:
    """A static DSelect-k MoE of frozen linear experts; the search at step 5 fixes a collapse
    that the gradient cannot (binary S(Z) has zero gradient)."""
    torch.manual_seed(5)
    n, k, d = 8, 2, 6
    experts = torch.randn(n, d)
    true = [3, 6]
    x = torch.randn(512, d)
    y = x @ experts[true].mean(0)
    gate = DSelectK(n, k, gamma=1.0)
    _collapsed(gate, code=0)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = gate

        def forward(self, xb: torch.Tensor) -> torch.Tensor:
            out = self.gate()
            return (xb @ experts.T) @ out.weights

    model = Model()
    probe = x[:256], y[:256]

    def member_loss() -> torch.Tensor:
        return F.mse_loss(model(probe[0]), probe[1]).reshape(1)

    cb = SwapSearch(gate, member_loss, at=[5])
    train(
        model,
        TaskData(x, [y]),
        None,
        TrainConfig(lr=0.01, batch_size=64, epochs=1, shuffle_seed=0),
        loss_fn=lambda m, b: (F.mse_loss(m(b.x), b.ys[0]), None),
        callbacks=[cb],
    )
    assert len(cb.results) == 1
    assert cb.total_moves is not None and int(cb.total_moves[0]) >= 1
    assert set(gate.selected_experts().nonzero().flatten().tolist()) == set(true)


def test_binarize_moves_fractional_selectors_to_distinct_codes() -> None:
    torch.manual_seed(6)
    gate = DSelectK(8, 3, gamma=1.0, num_gates=4)
    with torch.no_grad():
        gate.z.uniform_(-0.1, 0.1)  # every selector fractional
    w0 = gate.expert_weights().clone()

    def loss() -> torch.Tensor:  # the fractional start is optimal: only binarize moves
        return ((gate.expert_weights() - w0) ** 2).sum(-1)

    assert not gate.is_binary().any()
    res = swap_search(gate, loss, binarize=True)
    assert gate.is_binary().all()
    assert gate.num_selected().tolist() == [3] * 4  # distinct experts
    assert torch.all(res.loss_after > res.loss_before)  # binarizing cost loss here
    assert all(m >= 3 for m in res.moves.tolist())  # then normal moves may follow
    with pytest.raises(ValueError, match="binarize"):
        swap_search(TopKGate(8, 2), lambda: torch.zeros(()), binarize=True)


def test_binarize_separates_collided_binary_selectors() -> None:
    torch.manual_seed(7)
    gate = DSelectK(8, 3, gamma=1.0, num_gates=2)
    _collapsed(gate, code=5)  # binary, all on expert 5

    def loss() -> torch.Tensor:  # loves expert 5 only: a plain search keeps the collapse
        return -gate.expert_weights()[:, 5]

    assert swap_search(gate, loss).moves.tolist() == [0, 0]
    swap_search(gate, loss, binarize=True)
    assert gate.is_binary().all()
    assert gate.num_selected().tolist() == [3, 3]
    assert gate.selected_experts()[:, 5].all()  # one selector stays on the loved expert


def test_refit_bce_matches_a_converged_logistic_regression() -> None:
    from dselectk.search import logistic_refit_bce as _refit_bce

    torch.manual_seed(8)
    h = torch.randn(3, 400, 4)
    y = (h[0] @ torch.tensor([1.0, -1.0, 0.5, 0.0]) + 0.3 * torch.randn(400) > 0).float()
    got = _refit_bce(h, y, torch.zeros(3, 4), iters=30)
    for r in range(3):  # compare with LBFGS on the same ridge objective
        want = _lbfgs_bce(h[r], y)
        assert abs(float(got[r]) - want) < 1e-4


def _lbfgs_bce(h: torch.Tensor, y: torch.Tensor) -> float:
    w = torch.zeros(h.shape[-1], requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200, tolerance_grad=1e-10, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(h @ w, y) + 1e-3 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return float(F.binary_cross_entropy_with_logits(h @ w.detach(), y))


def test_at_fractions_turns_a_plan_into_steps() -> None:
    gate = DSelectK(8, k=2, num_gates=1)
    s = SwapSearch.at_fractions(gate, lambda: torch.zeros(1), 200, (0.25, 0.7, 0.7), 0.5, tol=0.0)
    assert sorted(s._at) == [50, 140] and sorted(s._binarize_at) == [100] and s.tol == 0.0
    assert sorted(SwapSearch.at_fractions(gate, lambda: torch.zeros(1), 3, (0.01,))._at) == [1]
    with pytest.raises(ValueError, match="fractions"):
        SwapSearch.at_fractions(gate, lambda: torch.zeros(1), 200, (0.0,))
    with pytest.raises(ValueError, match="steps_total"):
        SwapSearch.at_fractions(gate, lambda: torch.zeros(1), 0, (0.5,))


def test_selector_refit_mse_is_the_least_squares_fit_on_the_selected_experts() -> None:
    from dselectk.search import RefitStats, selector_refit_mse

    torch.manual_seed(0)
    reps, tasks, n, b = 2, 3, 8, 64
    gate = DSelectK(n, k=2, num_gates=reps * tasks, gamma=1.0)
    codes = torch.stack([torch.randperm(n)[:2] for _ in range(reps * tasks)])  # distinct
    with torch.no_grad():  # binary selectors on the codes (LSB-first bits)
        bits = ((codes.unsqueeze(-1) >> torch.arange(3)) & 1).float() * 2 - 1
        gate.logits[:, 2:] = bits.reshape(reps * tasks, -1)
    f = torch.rand(reps, n, b)
    y = torch.randn(tasks, b)
    got = selector_refit_mse(gate, RefitStats.of(f, y), ridge=0.0)
    for g in range(reps * tasks):
        r, t = divmod(g, tasks)
        a = f[r, codes[g]].T  # (B, 2): the two selected experts' outputs
        coef = torch.linalg.lstsq(a, y[t].unsqueeze(-1)).solution
        want = ((a @ coef).squeeze(-1) - y[t]).square().mean()
        torch.testing.assert_close(got[g], want, rtol=1e-4, atol=1e-6)
    # never above the model's own loss with its shares σ(α) (those are one feasible fit)
    pred = torch.bmm(gate().weights.view(reps, tasks, n), f)
    assert bool((got <= ((pred - y) ** 2).mean(-1).flatten() + 1e-6).all())
    with pytest.raises(ValueError, match="gates"):
        selector_refit_mse(gate, RefitStats.of(f, torch.randn(tasks + 1, b)))


def test_from_plan_reads_a_study_plan_and_rejects_unknown_keys() -> None:
    gate = DSelectK(8, k=2, num_gates=1)
    plan = {"at": (0.25, 0.7), "binarize": 0.5, "tol": 0.0}
    s = SwapSearch.from_plan(gate, lambda: torch.zeros(1), 100, plan)
    assert sorted(s._at) == [25, 70] and sorted(s._binarize_at) == [50]
    assert s.tol == 0.0
    with pytest.raises(ValueError, match="plan"):
        SwapSearch.from_plan(gate, lambda: torch.zeros(1), 100, {"at": (0.5,), "refit": True})
    with pytest.raises(ValueError, match="plan"):  # share_* went with issue 21
        SwapSearch.from_plan(gate, lambda: torch.zeros(1), 100, {"at": (0.5,), "share_tol": 0.1})
    with pytest.raises(ValueError, match="plan"):
        SwapSearch.from_plan(gate, lambda: torch.zeros(1), 100, {"binarize": 0.5})


def test_selector_refit_mse_of_a_topk_bank_fits_its_selected_experts() -> None:
    from dselectk.search import RefitStats, selector_refit_mse

    torch.manual_seed(1)
    gates, n, b = 4, 6, 50
    gate = TopKGate(n, k=3, num_gates=gates)
    f, y = torch.rand(1, n, b), torch.randn(gates, b)
    got = selector_refit_mse(gate, RefitStats.of(f, y), ridge=0.0)
    for t in range(gates):
        a = f[0, gate.logits[t].topk(3).indices].T  # (B, 3)
        want = (a @ torch.linalg.lstsq(a, y[t].unsqueeze(-1)).solution).squeeze(-1) - y[t]
        torch.testing.assert_close(got[t], want.square().mean(), rtol=1e-4, atol=1e-6)
