"""Token-MoE router options: a capacity limit (``capacity_factor``), off by default, and a
default command's records keep their identity. The issue 23 screens' research flags
(``--router-lr-scale``, ``--router-hidden``, ``--smooth-step-leak``, ``--router-start``) were
removed after the screens (commit ``539b307``): the CLI refuses them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dselectk.cli import main
from dselectk_research import token_moe as TM
from dselectk_research.char_lm import evaluate
from dselectk_research.token_moe.recipe import TokenMoEConfig

#: the settings every record stored before the capacity option existed
_RECORD_KEYS = {
    "balance_loss_weight", "batch_size", "corpus_bytes", "d_ff", "d_model", "entropy_reg",
    "gamma", "heads", "k", "layers", "lr", "num_experts", "renormalize", "seq_len", "steps",
    "val_fraction", "val_windows",
}  # fmt: skip
_TINY = dict(d_model=16, d_ff=16, heads=2, num_experts=4, seq_len=8)


#: the settings added with the capacity and router options
_LATER = {"capacity_factor", "entropy_reg_end", "entropy_warmup", "router_k"}


def test_every_record_stores_every_setting(tmp_path: Path) -> None:
    assert set(TM.DEFAULTS) == _RECORD_KEYS | _LATER
    assert TM.DEFAULTS["capacity_factor"] is None
    assert TokenMoEConfig(out=tmp_path).record_hparams() == TM.DEFAULTS
    ident = TokenMoEConfig(out=tmp_path, capacity_factor=1.25).record_hparams()
    assert set(ident) == _RECORD_KEYS | _LATER
    assert ident["capacity_factor"] == 1.25
    assert list(ident) == sorted(ident)


@pytest.mark.parametrize("router", ["topk", "dselect_k_distinct", "expert_choice"])
def test_capacity_factor_reaches_every_layer_and_only_when_set(router: str) -> None:
    # renormalize (the default) applies to token routing only
    hp = dict(TM.DEFAULTS, **_TINY, renormalize=TM.ROUTERS[router].routing == "token")
    torch.manual_seed(0)
    plain = TM.build_model(TM.ROUTERS[router], hp)
    torch.manual_seed(0)
    capped = TM.build_model(TM.ROUTERS[router], dict(hp, capacity_factor=0.5))
    assert all(m.capacity_factor is None for m in plain.moe_layers)
    assert all(m.capacity_factor == 0.5 for m in capped.moe_layers)
    # the same parameters (a capacity adds none): the same initialisation at one seed
    a, b = plain.state_dict(), capped.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(0, 256, (6, 8))
    tokens = x.numel()
    plain_m, capped_m = evaluate(plain, x, x), evaluate(capped, x, x)
    assert "dropped_pairs_per_token" not in plain_m
    for m in capped.moe_layers:
        cap = m.capacity(tokens)
        assert cap is not None and int(m.last_stats["load"].max()) <= cap  # type: ignore[index]
    if router == "expert_choice":  # expert choice has a capacity either way; nothing dropped
        assert "dropped_pairs_per_token" not in capped_m
        assert capped.moe_layers[0].capacity(tokens) == math.ceil(0.5 * tokens * 2 / 4)
        return
    # at c = 0.5 at most half of the k pairs of a token fit: at least k/2 dropped per token
    assert capped_m["dropped_pairs_per_token"] >= 1.0 - 1e-9
    assert plain_m["dispatched_experts_per_token"] == capped_m["dispatched_experts_per_token"]
    assert plain_m["bits_per_byte"] != capped_m["bits_per_byte"]


def test_cli_runs_the_capacity_and_records_it(tmp_path: Path) -> None:
    base = ["reproduce", "token-moe", "--seeds", "1", "--steps", "12", "--batch-size", "4",
            "--d-model", "16", "--d-ff", "16", "--num-experts", "4", "--corpus-bytes", "40000",
            "--seq-len", "16", "--val-windows", "8", "--jobs", "1", "--no-progress",
            "--gates", "topk", "dselect_k_distinct"]  # fmt: skip
    assert main([*base, "--out", str(tmp_path / "d")]) == 0
    assert main([*base, "--out", str(tmp_path / "o"), "--capacity-factor", "1.25"]) == 0
    for name, cap in (("d", None), ("o", 1.25)):
        records = [json.loads(p.read_text()) for p in (tmp_path / name / "runs").glob("*.json")]
        keys = _RECORD_KEYS | _LATER
        assert len(records) == 2 and all(set(r["config"]["hparams"]) == keys for r in records)
        assert all(r["config"]["hparams"]["capacity_factor"] == cap for r in records)
        capped = name == "o"
        assert all(("dropped_pairs_per_token" in r["metrics"]) == capped for r in records)
        report = (tmp_path / name / "report.md").read_text()
        assert ("capacity factor 1.25: each expert" in report) == capped
        assert ("no capacity limit" in report) != capped
    runs = [json.loads(p.read_text()) for p in (tmp_path / "o" / "runs").glob("*.json")]
    (rec,) = [r for r in runs if r["config"]["router"] == "topk"]
    assert rec["config"]["hparams"]["capacity_factor"] == 1.25
    assert rec["metrics"]["router_parameters"] == 2 * (16 * 4 + 4)  # a Linear(16, 4) per layer
    with pytest.raises(SystemExit):  # a capacity factor must be > 0
        main([*base, "--out", str(tmp_path / "z"), "--capacity-factor", "0"])


@pytest.mark.parametrize(
    "flag", [["--router-start", "0.3"], ["--router-hidden", "8"], ["--smooth-step-leak", "0.1"]]
)
def test_retired_research_flags_are_refused(
    tmp_path: Path, flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Removed after the issue 23 screens: argparse's unknown-argument error (exit code 2)."""
    with pytest.raises(SystemExit) as e:
        main(["reproduce", "token-moe", "--out", str(tmp_path / "x"), *flag])
    assert e.value.code == 2
    assert f"unrecognized arguments: {' '.join(flag)}" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
