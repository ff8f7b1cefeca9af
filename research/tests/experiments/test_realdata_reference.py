"""The MovieLens non-neural reference, the cost plan and the training-defaults flags."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from dselectk_research import movielens as ml
from dselectk_research.data.movielens import MovieLensSplit
from dselectk_research.data.movielens import baselines as nn_ref
from dselectk_research.realdata import plan
from dselectk_research.realdata.recipe import with_training_defaults
from dselectk_research.realdata.report import cached_reference
from dselectk_research.realdata.spec import record_config
from dselectk_research.records import run_id


def _data(rows: list[tuple[int, int, int, float]]) -> MovieLensSplit:
    """(user, item, watched, rating) rows → a MovieLens split (rating masked when unwatched)."""
    t = torch.tensor(rows, dtype=torch.float64)
    x = t[:, :2].to(torch.int64)
    return MovieLensSplit(x[:, 0], x[:, 1], t[:, 2].float(), t[:, 3].float(), t[:, 2].float())


# train: user 0 rated item 0 (4), did not watch item 1; user 1 rated items 0 (2) and 1 (5)
TRAIN = _data([(0, 0, 1, 4.0), (0, 1, 0, 0.0), (1, 0, 1, 2.0), (1, 1, 1, 5.0)])


def test_losses_by_hand() -> None:
    assert nn_ref.bce(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])) == pytest.approx(
        math.log(2)
    )
    pred, rating, mask = torch.tensor([3.0, 3.0]), torch.tensor([4.0, 0.0]), torch.tensor([1, 0])
    assert nn_ref.masked_mse(pred, rating, mask) == pytest.approx(0.5)  # 1² / 2 examples


def test_item_popularity_by_hand() -> None:
    p = nn_ref.item_popularity(TRAIN.item, TRAIN.watched, 2, prior=1.0)
    # overall rate 3/4; item 0: (2 + 0.75) / (2 + 1); item 1: (1 + 0.75) / (2 + 1)
    assert p.tolist() == pytest.approx([2.75 / 3, 1.75 / 3])


def test_fit_biases_by_hand() -> None:
    u, i = torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1])
    r = torch.tensor([4.0, 2.0, 5.0])  # μ = 11/3
    mu, bu, bi = nn_ref.fit_biases(u, i, r, 2, 2, reg=1.0, sweeps=1)
    assert mu == pytest.approx(11 / 3)
    # one sweep, λ = 1: b_i = Σ(r − μ)/(1 + n_i); then b_u = Σ(r − μ − b_i)/(1 + n_u)
    assert bi.tolist() == pytest.approx([-4 / 9, 2 / 3])
    assert bu.tolist() == pytest.approx([7 / 18, -5 / 27])
    # λ → 0 with many sweeps: the (underdetermined) fit interpolates the ratings
    mu, bu, bi = nn_ref.fit_biases(u, i, r, 2, 2, reg=1e-9, sweeps=500)
    assert (mu + bu[u] + bi[i]).tolist() == pytest.approx(r.tolist(), abs=1e-6)


def test_reference_metrics_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    test = _data([(0, 0, 1, 5.0), (1, 1, 0, 0.0)])
    ref = nn_ref.reference_metrics(TRAIN, test, test, 2, 2, priors=(1.0,), regs=(1.0,))
    const = ref["constant"]["test"]
    # constant: p = 3/4 for every pair, rating 11/3 (mean of the rated training pairs)
    assert const["loss_task1"] == pytest.approx(-(math.log(0.75) + math.log(0.25)) / 2)
    assert const["loss_task2"] == pytest.approx((5 - 11 / 3) ** 2 / 2)
    assert const["accuracy_task1"] == pytest.approx(0.5)
    pb = ref["popularity_biases"]
    assert pb["prior"] == 1.0 and pb["reg"] == 1.0
    p0, p1 = 2.75 / 3, 1.75 / 3  # popularity of items 0 and 1
    assert pb["test"]["loss_task1"] == pytest.approx(-(math.log(p0) + math.log(1 - p1)) / 2)
    assert pb["test"]["accuracy_task1"] == pytest.approx(0.5)  # p1 > 0.5 for an unwatched pair
    cfg = {"variant": "x", "fingerprint": "abc"}

    def compute() -> dict:
        return nn_ref.reference_metrics(TRAIN, test, test, 2, 2)

    first = cached_reference(tmp_path, cfg, compute)
    monkeypatch.setattr(nn_ref, "reference_metrics", lambda *a, **k: pytest.fail("recomputed"))
    assert cached_reference(tmp_path, cfg, compute) == first
    with pytest.raises(pytest.fail.Exception):  # other data: computed again
        cached_reference(tmp_path, {**cfg, "fingerprint": "d"}, compute)


def _args(**kw: object) -> argparse.Namespace:
    base = {"gates": list(ml.QUICK_GATES), "repetitions": None, "full": False, "epochs": None}
    base.update(grid_points=20, trials=5, init="keras", optimizer_defaults="tf")
    base.update(kw)
    return argparse.Namespace(**base)


def test_plan_estimate_by_hand() -> None:
    exp = ml.experiment()
    timing = {g: {"step_seconds": 0.1, "eval_seconds_per_example": 0.0} for g in ml.QUICK_GATES}
    est = plan.estimate(exp, _args(), [0.5], 1280, 100, timing, jobs=2)
    # 10 steps per epoch × 1 epoch × 0.1 s × 3 repetitions = 3 s per cell; 3 cells on 2 jobs
    assert est["runs"] == 9 and est["steps_per_epoch"] == 10
    assert est["cpu_seconds"] == pytest.approx(9.0) and est["wall_seconds"] == pytest.approx(6.0)
    full = plan.estimate(exp, _args(full=True, grid_points=2, trials=3), [0.5], 1280, 0, timing, 1)
    g = full["gates"]["softmax"]
    assert g["tune_runs"] == 6 and g["final_runs"] == 100
    assert g["final_steps_each"] == 10 * round(sum(ml.GRID["softmax"]["epochs"]) / 6)


def test_training_defaults_enter_the_run_identity() -> None:
    exp = with_training_defaults(ml.experiment(), _args(gates=None))
    assert exp.init == "keras" and exp.optimizer_defaults == "tf"
    torch_exp = with_training_defaults(ml.experiment(), _args(init="torch"))
    args = ("softmax", 0.5, {"lr": 0.1}, 0, 1, 0, {"fingerprint": "f"}, "final")
    a, b = record_config(exp, *args), record_config(torch_exp, *args)
    assert a["init"] == "keras" and b["init"] == "torch" and run_id(a) != run_id(b)


def test_report_rows_never_mix_training_defaults() -> None:
    from dselectk_research.realdata.report import current_records

    recs = [
        {"config": {"gate": "softmax", "alpha": 0.5, "init": i, "optimizer_defaults": "tf"}}
        for i in ("keras", "torch")
    ]
    kept = current_records(recs, "alpha", None, {}, {"init": "torch", "optimizer_defaults": "tf"})
    assert [r["config"]["init"] for r in kept] == ["torch"]
