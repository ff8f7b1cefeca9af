"""The DSelect-k math of Section 3 and Appendix B, checked against the paper's formulas."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.autograd import gradcheck

from dselectk import functional as DF

f64 = torch.float64


def paper_selector(p: torch.Tensor, n: int) -> torch.Tensor:
    """Eq. (r(z)_i) literally: r_i = prod_{j in B(i-1)} p_j prod_{j notin B(i-1)} (1 - p_j)."""
    m = p.shape[-1]
    out = []
    for i in range(1, n + 1):
        bits = {j + 1 for j in range(m) if (i - 1) >> j & 1}  # B(i-1), 1-based, LSB = 1
        term = torch.ones(p.shape[:-1], dtype=p.dtype)
        for j in range(1, m + 1):
            term = term * (p[..., j - 1] if j in bits else 1 - p[..., j - 1])
        out.append(term)
    return torch.stack(out, dim=-1)


# -- smooth-step (Section 3.1.3) -------------------------------------------------------------


@pytest.mark.parametrize("gamma", [0.1, 1.0, 10.0])
def test_smooth_step_matches_definition(gamma: float) -> None:
    t = torch.linspace(-gamma, gamma, 2001, dtype=f64)
    cubic = -2 / gamma**3 * t**3 + 3 / (2 * gamma) * t + 0.5
    expected = torch.where(t <= -gamma / 2, 0.0, torch.where(t >= gamma / 2, 1.0, cubic))
    torch.testing.assert_close(DF.smooth_step(t, gamma), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_smooth_step_exact_zero_one_outside(dtype: torch.dtype) -> None:
    gamma = 3.0
    t = torch.tensor([-100.0, -1.5, -1.5000001, 1.5, 1.50001, 7.0], dtype=dtype)
    out = DF.smooth_step(t, gamma)
    assert out.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert DF.smooth_step(torch.tensor(0.0, dtype=dtype), gamma).item() == 0.5


def test_smooth_step_is_c1() -> None:
    gamma = 2.0
    t = torch.tensor([-1.0, 1.0, -0.3, 0.0, 0.7], dtype=f64, requires_grad=True)
    (g,) = torch.autograd.grad(DF.smooth_step(t, gamma).sum(), t)
    analytic = -6 / gamma**3 * t.detach() ** 2 + 3 / (2 * gamma)
    torch.testing.assert_close(g, analytic)
    assert g[0].item() == 0.0 and g[1].item() == 0.0  # S'(±γ/2) = 0


def test_smooth_step_gradcheck_including_boundaries() -> None:
    gamma = 1.5
    t = torch.tensor([-2.0, -0.75, -0.3, 0.0, 0.4, 0.75, 3.0], dtype=f64, requires_grad=True)
    assert gradcheck(lambda x: DF.smooth_step(x, gamma), (t,), atol=1e-5)


@pytest.mark.parametrize("gamma", [0.0, -1.0, math.inf, math.nan])
def test_smooth_step_rejects_bad_gamma(gamma: float) -> None:
    with pytest.raises(ValueError, match="gamma"):
        DF.smooth_step(torch.zeros(3), gamma)


# -- the single expert selector (Section 3.1.1) -----------------------------------------------


def test_code_table_bits() -> None:
    table = DF.code_table(6)
    assert table.shape == (6, 3)
    assert table.int().tolist() == [
        [0, 0, 0],
        [1, 0, 0],
        [0, 1, 0],
        [1, 1, 0],
        [0, 0, 1],
        [1, 0, 1],
    ]


@pytest.mark.parametrize("m", range(1, 8))
def test_selector_equals_paper_product_formula(m: int) -> None:
    torch.manual_seed(m)
    p = torch.rand(3, m, dtype=f64)
    p[0, 0] = 0.0  # exact binary entries too
    p[1, -1] = 1.0
    n = 2**m
    torch.testing.assert_close(DF.selector(p), paper_selector(p, n))
    torch.testing.assert_close(DF.selector_naive(p), paper_selector(p, n))


@pytest.mark.parametrize("n", [3, 5, 6, 7, 9, 100, 127])
def test_selector_non_power_of_two_keeps_first_n(n: int) -> None:
    m = DF.num_bits(n)
    p = torch.rand(4, m, dtype=f64)
    torch.testing.assert_close(DF.selector(p, n), paper_selector(p, n))


def test_selector_four_experts_special_case() -> None:
    z1, z2 = 0.3, 0.8
    p = torch.tensor([z1, z2], dtype=f64)
    expected = [(1 - z1) * (1 - z2), z1 * (1 - z2), (1 - z1) * z2, z1 * z2]  # Eq. (r_z_4)
    torch.testing.assert_close(DF.selector(p), torch.tensor(expected, dtype=f64))


@pytest.mark.parametrize("m", range(1, 8))
def test_binary_selector_is_one_hot_of_code(m: int) -> None:
    for code in range(2**m):
        p = torch.tensor([(code >> j) & 1 for j in range(m)], dtype=f64)
        r = DF.selector(p)
        assert r.sum().item() == 1.0 and r[code].item() == 1.0


def test_selector_gradcheck() -> None:
    p = torch.rand(2, 4, dtype=f64, requires_grad=True)
    assert gradcheck(DF.selector, (p,))
    assert gradcheck(lambda q: DF.selector(q, 11), (p,))


def test_num_bits() -> None:
    assert [DF.num_bits(n) for n in (2, 3, 4, 5, 8, 9, 1024, 1025)] == [1, 2, 2, 3, 3, 4, 10, 11]
    with pytest.raises(ValueError, match="num_experts"):
        DF.num_bits(1)
    with pytest.raises(TypeError, match="num_experts"):
        DF.num_bits(4.0)  # type: ignore[arg-type]


# -- Proposition 2: outputs on the simplex ----------------------------------------------------

reals = st.floats(-20, 20, allow_nan=False)


@given(
    m=st.integers(1, 7),
    k=st.integers(1, 6),
    gamma=st.floats(0.01, 20),
    data=st.data(),
)
def test_proposition_2_simplex(m: int, k: int, gamma: float, data: st.DataObject) -> None:
    z = torch.tensor(data.draw(st.lists(reals, min_size=k * m, max_size=k * m)), dtype=f64)
    alpha = torch.tensor(data.draw(st.lists(reals, min_size=k, max_size=k)), dtype=f64)
    z = z.view(k, m)
    r = DF.selector(DF.smooth_step(z, gamma))
    assert (r >= 0).all()
    torch.testing.assert_close(r.sum(-1), torch.ones(k, dtype=f64))
    q = DF.dselect_k_weights(alpha, z, gamma)
    assert (q >= 0).all() and q.shape == (2**m,)
    torch.testing.assert_close(q.sum(), torch.tensor(1.0, dtype=f64))


def binary_z(codes: list[int], m: int, gamma: float) -> torch.Tensor:
    """Z whose smooth-step is the binary codes (±γ lies outside [-γ/2, γ/2])."""
    bits = torch.tensor([[(c >> j) & 1 for j in range(m)] for c in codes], dtype=f64)
    return (2 * bits - 1) * gamma


@given(m=st.integers(1, 6), k=st.integers(1, 6), data=st.data())
def test_at_most_k_nonzeros_when_binary(m: int, k: int, data: st.DataObject) -> None:
    codes = data.draw(st.lists(st.integers(0, 2**m - 1), min_size=k, max_size=k))
    alpha = torch.tensor(data.draw(st.lists(reals, min_size=k, max_size=k)), dtype=f64)
    q = DF.dselect_k_weights(alpha, binary_z(codes, m, 2.0), 2.0)
    assert int((q > 0).sum()) <= k
    assert set((q > 0).nonzero().flatten().tolist()) <= set(codes)


# -- Proposition 1: every w with <= k nonzeros on the simplex is reachable ----------------------


def proposition_1_construction(w: torch.Tensor, k: int) -> tuple[torch.Tensor, list[int]]:
    """α and the codes of Appendix B.1's proof (direction II)."""
    order = [int(i) for i in torch.argsort(w, descending=True) if w[i] > 0]
    s = len(order)
    codes = order + [order[-1]] * (k - s)
    if s == k:
        alpha = [math.log(w[t]) for t in order]
    else:
        alpha = [math.log(w[t]) for t in order[: s - 1]]
        alpha += [math.log(w[order[-1]] / (k - s + 1))] * (k - s + 1)
    return torch.tensor(alpha, dtype=f64), codes


@given(m=st.integers(1, 6), k=st.integers(1, 5), data=st.data())
def test_proposition_1_construction(m: int, k: int, data: st.DataObject) -> None:
    n = 2**m
    s = data.draw(st.integers(1, min(k, n)))
    support = data.draw(st.lists(st.integers(0, n - 1), min_size=s, max_size=s, unique=True))
    vals = data.draw(st.lists(st.floats(0.05, 1.0), min_size=s, max_size=s))
    w = torch.zeros(n, dtype=f64)
    w[support] = torch.tensor(vals, dtype=f64) / sum(vals)
    alpha, codes = proposition_1_construction(w, k)
    q = DF.dselect_k_weights(alpha, binary_z(codes, m, 1.0), 1.0)
    torch.testing.assert_close(q, w)


# -- gradients -------------------------------------------------------------------------------


def test_dselect_k_weights_gradcheck() -> None:
    torch.manual_seed(0)
    alpha = torch.randn(3, 4, dtype=f64, requires_grad=True)
    z = (torch.rand(3, 4, 3, dtype=f64) - 0.5).requires_grad_()
    assert gradcheck(lambda a, b: DF.dselect_k_weights(a, b, 1.5, 6), (alpha, z))


def test_gradient_wrt_z_is_exactly_zero_once_binary() -> None:
    gamma = 2.0
    z = binary_z([1, 5, 2], 3, gamma).requires_grad_()
    alpha = torch.randn(3, dtype=f64, requires_grad=True)
    q = DF.dselect_k_weights(alpha, z, gamma)
    loss = (q * torch.arange(8, dtype=f64)).sum() + DF.selector_entropy(
        DF.smooth_step(z, gamma)
    ).sum()
    loss.backward()
    assert z.grad is not None and (z.grad == 0).all()
    assert alpha.grad is not None and alpha.grad.abs().sum() > 0


# -- entropy regulariser ---------------------------------------------------------------------


@given(m=st.integers(1, 7), data=st.data())
def test_entropy_identity(m: int, data: st.DataObject) -> None:
    """h(r(p)) = Σ_j h(p_j): the O(m) formula equals the entropy of the 2^m-vector."""
    vals = data.draw(st.lists(st.floats(0.0, 1.0), min_size=m, max_size=m))
    p = torch.tensor(vals, dtype=f64)
    torch.testing.assert_close(DF.selector_entropy(p), DF.entropy(DF.selector(p)))


def test_entropy_safe_at_exact_zero_one() -> None:
    p = torch.tensor([0.0, 1.0, 0.5], dtype=f64, requires_grad=True)
    h = DF.binary_entropy(p)
    assert h[:2].tolist() == [0.0, 0.0]
    assert math.isclose(h[2].item(), math.log(2))
    h.sum().backward()
    assert p.grad is not None and torch.isfinite(p.grad).all()
    # through the smooth-step, binary bits get exactly zero gradient (no 0 * inf = NaN)
    z = torch.tensor([-5.0, 5.0, 0.1], dtype=f64, requires_grad=True)
    DF.selector_entropy(DF.smooth_step(z, 1.0)).backward()
    assert z.grad is not None and z.grad[:2].tolist() == [0.0, 0.0] and torch.isfinite(z.grad).all()


# -- Appendix B.2 penalty --------------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 5, 6, 7, 11, 100])
def test_unused_code_penalty_equals_definition(n: int) -> None:
    m = DF.num_bits(n)
    p = torch.rand(5, m, dtype=f64)
    expected = 0.3 / DF.selector(p, n).sum(-1)
    torch.testing.assert_close(DF.unused_code_penalty(p, n, 0.3), expected)


def test_unused_code_penalty_zero_for_powers_of_two_and_finite_on_unused_code() -> None:
    p = torch.rand(2, 3, dtype=f64)
    assert (DF.unused_code_penalty(p, 8, 1.0) == 0).all()
    # code 7 is unused for n = 5: Σ_{i<=5} r = 0 exactly -> large but finite
    out = DF.unused_code_penalty(torch.ones(3, dtype=f64), 5, 1.0)
    assert torch.isfinite(out) and out > 1e10


def test_unused_code_penalty_gradcheck() -> None:
    p = (torch.rand(3, 3, dtype=f64) * 0.8 + 0.1).requires_grad_()
    assert gradcheck(lambda q: DF.unused_code_penalty(q, 5, 0.7), (p,))


# -- Top-k (Section 2) -----------------------------------------------------------------------


@given(n=st.integers(2, 16), data=st.data())
def test_topk_equals_definition(n: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, n))
    vals = data.draw(st.lists(st.floats(-10, 10), min_size=n, max_size=n, unique=True))
    v = torch.tensor(vals, dtype=f64)
    expected = torch.softmax(DF.keep_topk(v, k), dim=-1)
    torch.testing.assert_close(DF.topk_softmax(v, k), expected)
    assert int((DF.topk_softmax(v, k) > 0).sum()) == k
    kept = set(torch.argsort(v, descending=True)[:k].tolist())
    assert set((DF.keep_topk(v, k) > -math.inf).nonzero().flatten().tolist()) == kept


def test_naive_and_fast_selector_agree_in_gradients() -> None:
    p = torch.rand(4, 5, dtype=f64, requires_grad=True)
    g1 = torch.autograd.grad((DF.selector(p) * torch.arange(32)).sum(), p)[0]
    g2 = torch.autograd.grad((DF.selector_naive(p) * torch.arange(32)).sum(), p)[0]
    torch.testing.assert_close(g1, g2)


def test_product_over_all_binary_codes_is_complete() -> None:
    m = 3
    for bits in itertools.product([0.0, 1.0], repeat=m):
        r = DF.selector(torch.tensor(bits, dtype=f64))
        assert r.sum().item() == 1.0
