"""``dselectk reproduce selection``: a tiny end-to-end run through the CLI, the protocol before
the results, paired seeds, flag validation, the test set and the frozen search-only gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dselectk.cli import main
from dselectk_research.executors import LocalExecutor
from dselectk_research.recovery import RecoveryData
from dselectk_research.runner import run_recipe
from dselectk_research.selection import ARMS, PROTOCOL
from dselectk_research.selection.recipe import SelectionConfig, recipe
from dselectk_research.selection.report import paired
from dselectk_research.selection.study import (
    BUDGET_ARMS,
    SEED_RANGE,
    C1Sizes,
    HeldOutData,
    budget_epochs,
    data_seed,
    hparams_of,
    init_seed,
    max_probe_passes,
)

#: the tiny run's arms: all but the equal-budget ones (50+ epochs each; tested on their config)
ARMS_RUN = [a for a in ARMS if a not in BUDGET_ARMS]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("selection")
    argv = ["reproduce", "selection", "--out", str(out), "--shapes", "16/2", "--reps", "2",
            "--epochs", "1", "--lrs", "0.1", "0.01", "--no-progress", "--jobs", "1",
            "--tasks", "--arms", *ARMS_RUN]  # fmt: skip
    assert main(argv) == 0
    return out


def _records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]


def test_end_to_end_report(tiny: Path) -> None:
    summary = json.loads((tiny / "summary.json").read_text())
    rows = summary["shapes"]["16/2"]["rows"]
    assert {r["arm"] for r in rows} == set(ARMS_RUN)
    for r in rows:
        assert r["metrics"]["recovered"]["n"] == 2
        assert (r["metrics"]["probe_passes"]["mean"] > 0) == (ARMS[r["arm"]].search is not None)
    assert summary["retrain_same_selection"] == summary["tests"] == 2 * len(ARMS_RUN)
    pairs = {(p["arm"], p["against"]) for p in summary["shapes"]["16/2"]["paired"]}
    assert ("dselect_k_search", "search_only") in pairs
    assert ("dselect_k_search", "topk_search") in pairs
    text = (tiny / "report.md").read_text()
    assert PROTOCOL.splitlines()[0] in text and "Verdict" in text
    assert text.index("## Protocol") < text.index(PROTOCOL.splitlines()[-1]) < text.index("| arm |")
    passes = {r["arm"]: r["metrics"]["probe_passes"]["mean"] for r in rows}
    row = "  | recovery, n = 16, k = 2 | " + " | ".join(
        f"{passes[a]:.0f}" for a in ("dselect_k_search", "topk_search", "search_only")
    )
    assert "  | setting | dselect_k_search | topk_search | search_only |" in text and row in text
    (tiny / "report.md").unlink()
    assert main(["report", str(tiny)]) == 0
    assert (tiny / "report.md").read_text() == text


def test_seeds_are_paired_across_arms(tiny: Path) -> None:
    recs = _records(tiny)
    assert len(recs) == len(ARMS_RUN) * 2 * 3  # 2 reps × (2 lrs + the test retrain)
    by_rep: dict[int, set] = {}
    for r in recs:
        c = r["config"]
        by_rep.setdefault(c["rep"], set()).add((c["init_seed"], c["shuffle_seed"], c["data_seed"]))
        assert SEED_RANGE[0] <= c["data_seed"] <= SEED_RANGE[1]
    assert all(len(v) == 1 for v in by_rep.values())  # every arm, lr and phase: one seed per rep
    assert len({next(iter(v)) for v in by_rep.values()}) == 2
    assert init_seed(0) != init_seed(1)


@pytest.mark.parametrize(
    "flags",
    [["--shapes", "16/5"], ["--shapes", "16x4"], ["--shapes", "8/0"], ["--reps", "1"],
     ["--arms", "nope"], ["--lrs", "0"], ["--epochs", "0"]],
)  # fmt: skip
def test_flag_validation(flags: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main(["reproduce", "selection", "--out", str(tmp_path / "o"), *flags])
    assert e.value.code == 2


def test_dry_run_prints_plan_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "o"
    assert main(["reproduce", "selection", "--out", str(out), "--full", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "Plan:" in text and "64/6" in text and "CPU-minutes" in text
    assert "C.1 at T = 32, 64, 128" in text and "100,000 training examples" in text
    assert text.index("## Protocol") < text.index("Plan:")
    assert not out.exists()


def test_test_set_has_the_generating_model() -> None:
    base = RecoveryData(data_seed(16, 2), 500, 500, num_true=2)
    test = HeldOutData(base, n_test=300)
    assert torch.equal(test.labels(base.x_train), base.y_train)
    assert torch.equal(test.labels(base.x_val), base.y_val)
    assert test.x_val.shape == (300, base.x_train.shape[1])
    assert not torch.equal(test.x_val[:300], base.x_val[:300])


def test_search_only_freezes_the_selection_not_the_shares() -> None:
    gate = ARMS["search_only"].build(16, hparams={"gamma": 10.0}, k=2, num_gates=3)
    assert ARMS["search_only"].identity()["selection_frozen"] is True
    assert "selection_frozen" not in ARMS["dselect_k_search"].identity()
    torch.manual_seed(0)
    (gate().weights * torch.randn(3, 16)).sum().backward()
    grad = gate.logits.grad
    assert grad is not None
    assert torch.all(grad[:, 2:] == 0) and grad[:, :2].abs().sum() > 0  # Z frozen, α trains
    before = gate.selection().clone()
    opt = torch.optim.Adam(gate.parameters(), lr=0.5)
    for _ in range(5):
        opt.zero_grad()
        (gate().weights * torch.randn(3, 16)).sum().backward()
        opt.step()
    assert torch.equal(gate.selection(), before)  # only the search moves the selection
    free = ARMS["dselect_k_search"].build(16, hparams={"gamma": 10.0}, k=2, num_gates=3)
    (free().weights * torch.randn(3, 16)).sum().backward()
    assert free.logits.grad is not None and free.logits.grad[:, 2:].abs().sum() > 0


def test_paired_differences() -> None:
    p = paired({0: 3.0, 1: 2.0, 2: 1.0, 3: 4.0}, {0: 1.0, 1: 2.0, 2: 2.0})
    assert (p["n"], p["win"], p["tie"], p["loss"]) == (3, 1, 1, 1)
    assert p["mean"] == pytest.approx(1 / 3)


def test_budget_arms_get_the_probe_examples_as_epochs(tmp_path: Path) -> None:
    for epochs in (None, 1):
        cfg = SelectionConfig(out=tmp_path, shapes=((16, 2),), epochs=epochs)
        base = 50 if epochs is None else 1
        for a in ARMS:
            want = budget_epochs(base, 16, 2) if a in BUDGET_ARMS else base
            assert hparams_of(cfg, ARMS[a], (16, 2))["epochs"] == want
    # 1 epoch + the largest search arm's bound of probe passes x 2048 probe inputs / 10,000
    bound = max(max_probe_passes(ARMS[a], 16, 2) for a in ("dselect_k_search", "topk_search"))
    assert budget_epochs(1, 16, 2) == 1 + -(-bound * 2048 // 10_000) > 50
    assert budget_epochs(50, 32, 3) > budget_epochs(50, 16, 4) > budget_epochs(50, 16, 2)


@pytest.fixture(scope="module")
def tiny_c1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("selection_c1")
    cfg = SelectionConfig(
        out=out, arms=("topk", "dselect_k_search", "search_only"), shapes=(), tasks=(16,),
        c1=C1Sizes(256, 128, 128, points=1, trials=1, reps=2),
    )  # fmt: skip
    assert run_recipe(recipe(cfg), cfg, LocalExecutor(jobs=1, threads=1, progress=False)) == 0
    return out


def test_c1_cells_tune_on_validation_and_pair_the_test_runs(tiny_c1: Path) -> None:
    recs = _records(tiny_c1)
    tune = [r for r in recs if r["config"]["phase"] == "tune"]
    test = [r for r in recs if r["config"]["phase"] == "test"]
    assert tune and all(r["config"]["data"]["study"] == "selection" for r in tune)
    # tuning never reads the test split: it is replaced by the validation split
    assert all(r["metrics"]["test_mse"] == r["metrics"]["val_mse"] for r in tune)
    assert all(r["metrics"]["test_mse"] != r["metrics"]["val_mse"] for r in test)
    epochs = {r["config"]["hparams"]["epochs"] for r in tune}
    assert epochs <= {25, 50, 75, 100} and len(epochs) > 1  # epochs are tuned
    seeds = {(r["config"]["rep"], r["config"]["init_seed"]) for r in test}
    assert seeds == {(0, init_seed(0)), (1, init_seed(1))}  # the same per repetition, every arm
    assert {r["config"]["arm"] for r in test} == {"topk", "dselect_k_search", "search_only"}
    for r in test:
        assert (r["metrics"]["probe_passes"] > 0) == (r["config"]["arm"] != "topk")
    summary = json.loads((tiny_c1 / "summary.json").read_text())
    s = summary["c1"]["16"]
    assert s["best_baseline"] == "topk"
    pairs = {(p["arm"], p["against"]) for p in s["paired"]}
    assert ("dselect_k_search", "search_only") in pairs and ("search_only", "topk") in pairs
    text = (tiny_c1 / "report.md").read_text()
    assert "Appendix C.1, T = 16" in text and "Appendix C.1:" in text
