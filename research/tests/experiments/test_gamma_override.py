"""``--gamma`` of the real-data recipes (issue 23): a bad value is refused naming the flag, the
value reaches the gates that declare γ (and only those), and records made with different γ are
different runs, never mixed in one summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_realdata import write_ml100k

from dselectk.cli import main
from dselectk_research import multi_mnist as mm
from dselectk_research.realdata import recipe as rd_recipe
from dselectk_research.records import RunStore

ML = ["reproduce", "movielens", "--no-progress"]
MM = ["reproduce", "multi-mnist", "--no-progress"]


@pytest.mark.parametrize("base", [ML, MM], ids=["movielens", "multi-mnist"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "abc"])
def test_bad_gamma_exits_2_naming_the_flag(
    base: list[str], value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main([*base, "--out", str(tmp_path / "out"), "--gamma", value])
    assert e.value.code == 2
    assert "argument --gamma" in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "out").exists()  # refused before any work


def test_gamma_applies_only_to_gates_that_declare_it() -> None:
    exp = mm.experiment("multi-mnist")
    assert rd_recipe.with_gamma(exp, None) is exp
    new = rd_recipe.with_gamma(exp, 10.0)
    for gate, hp in new.quick_hparams.items():
        if rd_recipe.declares_gamma(gate):
            assert hp["gamma"] == 10.0 and new.grid[gate]["gamma"] == [10.0]
            rest = {k: v for k, v in hp.items() if k != "gamma"}
            assert rest == {k: v for k, v in exp.quick_hparams[gate].items() if k != "gamma"}
        else:
            assert "gamma" not in hp and "gamma" not in new.grid[gate]
            assert hp == exp.quick_hparams[gate] and new.grid[gate] == exp.grid[gate]
    assert rd_recipe.declares_gamma("dselect_k_per_example")
    assert not rd_recipe.declares_gamma("topk_per_example")
    assert not rd_recipe.declares_gamma("shared_bottom")
    # the built model's gates carry the override (the quick default is 0.1)
    assert exp.quick_hparams["dselect_k_per_example"]["gamma"] == 0.1
    model = mm.build_model("dselect_k_per_example", new.quick_hparams["dselect_k_per_example"], {})
    gamma = model.gates.gamma  # type: ignore[union-attr]
    assert torch.allclose(torch.as_tensor(gamma, dtype=torch.float32), torch.tensor(10.0))


def test_gamma_reaches_the_config_and_the_recipe(tmp_path: Path) -> None:
    parser_args: list[str] = [*MM, "--out", str(tmp_path), "--gamma", "2.5", "--dry-run"]
    import argparse

    p = argparse.ArgumentParser()
    mm.add_arguments(p)
    args = p.parse_args(parser_args[2:])
    assert args.gamma == 2.5
    config = rd_recipe.config_of(mm.MultiMNISTConfig, args, n_train=1, n_val=1, n_test=1)
    assert config.gamma == 2.5
    recipe = rd_recipe.build_recipe(mm.experiment("multi-mnist"), config)
    exp = recipe.run_cell.args[0]  # type: ignore[attr-defined]
    assert exp.quick_hparams["dselect_k_static"]["gamma"] == 2.5
    assert "gamma" not in exp.quick_hparams["topk_static"]


_UNVERIFIED = pytest.mark.filterwarnings("ignore:checksum verification:UserWarning")


def _argv(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        *ML, "--variant", "ml-100k", "--data-dir", str(data), "--out", str(out),
        "--alphas", "0.5", "--gates", "dselect_k_static", "topk_static", "--epochs", "1",
        "--repetitions", "1", *extra,
    ]  # fmt: skip


def _runs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]


@_UNVERIFIED
def test_records_differ_by_gamma_and_never_mix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSELECTK_VERIFY", "0")
    write_ml100k(tmp_path / "data")
    out = tmp_path / "res"
    assert main(_argv(tmp_path / "data", out, "--gamma", "3")) == 0
    recs = _runs(out)
    assert len(recs) == 2
    by_gate = {r["config"]["gate"]: r for r in recs}
    assert by_gate["dselect_k_static"]["config"]["hparams"]["gamma"] == 3.0
    assert "gamma" not in by_gate["topk_static"]["config"]["hparams"]
    # another γ in the same folder: a new DSelect-k run; Top-k's record is reused
    assert main(_argv(tmp_path / "data", out, "--gamma", "5")) == 0
    recs = _runs(out)
    assert len(recs) == 3
    gammas = sorted(
        r["config"]["hparams"]["gamma"] for r in recs if r["config"]["gate"] == "dselect_k_static"
    )
    assert gammas == [3.0, 5.0]
    planned, others = RunStore(out).load_planned()
    assert others == 1  # the γ = 3 run is kept but not summarised with the γ = 5 one
    assert sorted(r["config"]["hparams"].get("gamma", -1.0) for r in planned) == [-1.0, 5.0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["records"] == 2  # one run per gate: γ = 5's, not averaged with γ = 3's
    rows = {row["gate"]: row for row in summary["rows"]}
    assert rows["dselect_k_static"]["runs"] == 1
    # the same γ again trains nothing new
    assert main(_argv(tmp_path / "data", out, "--gamma", "5")) == 0
    assert len(_runs(out)) == 3
