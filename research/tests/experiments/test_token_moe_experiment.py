"""Token-MoE recipe: the stdlib corpus, the model, and a tiny run through the CLI."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from dselectk.cli import main
from dselectk.gates import DSelectK, DSelectKExtended
from dselectk_research import token_moe as TM
from dselectk_research.char_lm import train_bytes_per_token
from dselectk_research.data.text import load_corpus
from dselectk_research.report import experiment_name, rebuild


def test_corpus_is_deterministic() -> None:
    a, b = load_corpus(50_000), load_corpus(50_000)
    assert a.sha256 == b.sha256 and a.files == sorted(a.files, key=str)
    assert torch.equal(a.train, b.train) and len(a.train) + len(a.val) == 50_000
    assert not any("site-packages" in f or f.startswith("test/") for f in a.files)


def test_model_shapes_and_aux() -> None:
    hp = dict(TM.DEFAULTS, d_model=16, d_ff=16, heads=2, num_experts=4, seq_len=8)
    model = TM.build_model(TM.ROUTERS["dselect_k"], hp)
    logits, aux = model(torch.randint(0, 256, (3, 8)))
    assert logits.shape == (3, 8, 256) and aux.dim() == 0 and float(aux.detach()) > 0


def test_tiny_run_records_and_report(tmp_path: Path) -> None:
    out = tmp_path / "tm"
    argv = ["reproduce", "token-moe", "--out", str(out), "--seeds", "1", "--steps", "15",
            "--batch-size", "8", "--d-model", "16", "--d-ff", "16", "--num-experts", "4",
            "--corpus-bytes", "40000", "--seq-len", "16", "--val-windows", "16",
            "--jobs", "1", "--no-progress", "--gates", "dselect_k", "topk"]  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    assert {r["config"]["router"] for r in records} == {"dselect_k", "topk"}
    for r in records:
        m = r["metrics"]
        assert 0 < m["val_bpc"] < 9 and m["steps"] == 15
        assert len(m["load"]) == 2 and abs(sum(m["load"][0]) - 1) < 1e-6
        assert len(r["config"]["corpus"]["files_sha256"]) == 64 and r["corpus_files"]
    dk = next(r for r in records if r["config"]["router"] == "dselect_k")["metrics"]
    assert 0 <= dk["binary_token_fraction"] <= 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["records"] == 2 and "bits/byte" in (out / "report.md").read_text()
    assert experiment_name(out) == "token-moe"
    # resume: nothing left to run; report rebuilds from records alone
    assert main(argv) == 0
    assert len(list((out / "runs").glob("*.json"))) == 2
    (out / "report.md").unlink()
    assert rebuild(out) == "token-moe" and (out / "report.md").is_file()


def test_telemetry_flag_logs_routing_per_run(tmp_path: Path) -> None:
    out = tmp_path / "tm"
    argv = ["reproduce", "token-moe", "--out", str(out), "--seeds", "1", "--steps", "20",
            "--batch-size", "8", "--d-model", "16", "--d-ff", "16", "--num-experts", "4",
            "--corpus-bytes", "40000", "--seq-len", "16", "--val-windows", "16",
            "--jobs", "1", "--no-progress", "--telemetry",
            "--gates", "dselect_k", "topk"]  # fmt: skip
    assert main(argv) == 0
    runs = sorted(p.name for p in (out / "telemetry").iterdir())
    assert runs == ["dselect_k-seed0", "topk-seed0"]
    for run in runs:
        files = list((out / "telemetry" / run).iterdir())
        assert files, run  # an event file (TensorBoard) or routing.jsonl
        jsonl = out / "telemetry" / run / "routing.jsonl"
        if jsonl.is_file():
            lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
            assert [r["step"] for r in lines] == list(range(1, 21))  # every = 20 // 20
            assert all("experts" in g for r in lines for g in r["gates"].values())


def test_routers_are_variants() -> None:
    assert list(TM.ROUTERS) == ["dselect_k", "topk", "dselect_k_distinct", "dselect_k_diversity",
                                "expert_choice"]  # fmt: skip
    assert TM.DEFAULT_ROUTERS == ("dselect_k", "topk", "dselect_k_distinct", "dselect_k_diversity")
    hp = dict(
        TM.DEFAULTS,
        d_model=16,
        d_ff=16,
        heads=2,
        num_experts=4,
        seq_len=8,
        gamma=2.0,
        entropy_reg=0.01,
    )
    dk = TM.build_model(TM.ROUTERS["dselect_k"], hp).moe_layers[0].gate
    assert (
        dk.binarizes
        and float(dk.gamma) == 2.0
        and math.isclose(float(dk.entropy_reg), 0.01, rel_tol=1e-6)
    )
    top = TM.build_model(TM.ROUTERS["topk"], hp).moe_layers[1].gate
    assert not top.binarizes and top.k == 2 and top.num_experts == 4
    assert not dk.distinct and type(dk) is DSelectK  # the paper's gate (no diversity term)
    distinct = TM.build_model(TM.ROUTERS["dselect_k_distinct"], hp).moe_layers[0].gate
    assert distinct.distinct and float(distinct.gamma) == 2.0
    diverse = TM.build_model(TM.ROUTERS["dselect_k_diversity"], hp).moe_layers[0].gate
    assert math.isclose(float(diverse.diversity), 0.1, rel_tol=1e-6) and not diverse.distinct
    assert type(diverse) is DSelectKExtended


_TINY = ["reproduce", "token-moe", "--seeds", "1", "--steps", "15", "--batch-size", "8",
         "--d-model", "16", "--d-ff", "16", "--num-experts", "4", "--corpus-bytes", "40000",
         "--seq-len", "16", "--val-windows", "16", "--jobs", "1", "--no-progress"]  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--val-windows", "0"), ("--layers", "0"), ("--seeds", "0"), ("--steps", "10"),
     ("--steps", "5"), ("--num-experts", "1"), ("--lr", "0"), ("--gamma", "0"),
     ("--entropy-reg", "-1"), ("--seq-len", "0"), ("--batch-size", "nan"),
     ("--entropy-reg-end", "-1"), ("--entropy-warmup", "1"), ("--entropy-warmup", "-0.1"),
     ("--router-k", "0"), ("--router-k", "2.5")],
)  # fmt: skip
def test_bad_numeric_flags_stop_before_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    out = tmp_path / "tm"
    with pytest.raises(SystemExit) as e:
        main([*_TINY, "--out", str(out), flag, value])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--d-model", "18"], "--d-model 18: must be a multiple of the 4 attention heads"),
     (["--corpus-bytes", "150"], "--corpus-bytes 150: too small"),
     (["--corpus-bytes", "649", "--seq-len", "64"], "at least 650"),
     (["--k", "5"], "--k 5: at most --num-experts (4)"),
     (["--entropy-warmup", "0.5"], "--entropy-warmup 0.5: needs --entropy-reg-end"),
     (["--router-k", "1"], "--router-k 1: from --k (2) to --num-experts (4)"),
     (["--router-k", "5"], "--router-k 5: from --k (2) to --num-experts (4)")],
)  # fmt: skip
def test_inconsistent_flags_stop_before_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    out = tmp_path / "tm"
    assert main([*_TINY, "--out", str(out), *argv]) == 2
    assert message in capsys.readouterr().err and not out.exists()
    TM.TokenMoEConfig(out, corpus_bytes=650)  # the least that fits one window of 64 bytes


def test_report_summarises_this_commands_runs_only(tmp_path: Path) -> None:
    """A 12-step and a 13-step run in one folder were averaged as n = 2."""
    out = tmp_path / "tm"
    base = ["reproduce", "token-moe", "--out", str(out), "--seeds", "1", "--gates", "topk",
            "--batch-size", "8", "--d-model", "16", "--d-ff", "16", "--num-experts", "4",
            "--corpus-bytes", "40000", "--seq-len", "16", "--val-windows", "16",
            "--jobs", "1", "--no-progress"]  # fmt: skip
    assert main([*base, "--steps", "12"]) == 0
    assert main([*base, "--steps", "13"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["records"] == 1 and summary["records_not_summarised"] == 1
    assert summary["hparams"]["steps"] == 13
    assert "not summarised: 1" in (out / "report.md").read_text()


def test_val_windows_is_a_maximum_and_the_count_is_reported(tmp_path: Path) -> None:
    out = tmp_path / "tm"
    # 40,000 bytes: the validation part (4,000 bytes) holds 249 windows of 16 bytes
    argv = [*_TINY, "--out", str(out), "--val-windows", "100000", "--gates", "topk"]
    assert main(argv) == 0
    (rec,) = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert rec["metrics"]["val_windows"] == 249
    assert "a fixed set of 249 non-overlapping" in (out / "report.md").read_text()


def test_a_batch_that_cannot_fit_in_memory_is_refused_with_an_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tm"
    assert main([*_TINY, "--out", str(out), "--batch-size", "100000000"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size 100000000 × --seq-len 16 (training activations): about" in err
    assert "GiB" in err and not out.exists()
    cfg = TM.TokenMoEConfig(out)  # the default study fits: about 47 MB of activations a step
    assert cfg.batch_size * cfg.seq_len * train_bytes_per_token(cfg.hparams()) < 2**27


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_diverged_runs_are_recorded_counted_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], jobs: str
) -> None:
    """A learning rate that diverges was a traceback (one process) or a BrokenProcessPool."""
    out = tmp_path / "tm"
    argv = [*_TINY, "--out", str(out), "--gates", "topk", "dselect_k", "--lr", "1e30"]
    argv += ["--jobs", jobs]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "2 run(s) diverged" in err and "Top-k seed 0 (step" in err
    records = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert len(records) == 2 and all(r["diverged"] for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged"] == 2 and all(r["diverged"] == 1 for r in summary["rows"])
    report = (out / "report.md").read_text()
    assert "**2 run(s) diverged" in report and "no comparison" in report
    assert main(["report", str(out)]) == 1  # rebuilt from the records alone; exit 1 as the sweep
    assert json.loads((out / "summary.json").read_text())["diverged"] == 2


def test_a_routers_ramps_move_its_hyperparameter_in_every_layer() -> None:
    """A router variant's schedules (here γ, 8 → the run's own 2 over half the steps) are applied
    to every MoE layer's router during training, not ignored."""
    from dselectk.training import Callback
    from dselectk.variants import Ramp, Variant
    from dselectk_research.token_moe.model import train_run

    variant = Variant(
        "ramped", "dselect_k", "ramped", schedules=(Ramp("gamma", start=8.0, span=0.5),)
    )
    hp = dict(TM.DEFAULTS, d_model=16, d_ff=16, heads=2, num_experts=4, seq_len=16)
    hp.update(steps=20, batch_size=8, val_windows=16, gamma=2.0)
    seen: list[list[float]] = []

    class Watch(Callback):
        def on_step(self, model, batch, out, history):  # type: ignore[no-untyped-def]
            seen.append([float(m.gate.gamma) for m in model.moe_layers])

    m = train_run(
        variant, hp, load_corpus(40_000), 0, progress=False, desc="t", callbacks=[Watch()]
    )
    assert math.isfinite(m["val_bpc"]) and len(seen) == 20
    assert all(len(set(s)) == 1 for s in seen)  # every layer's router on the same schedule
    first = [s[0] for s in seen]
    assert first[0] < 8.0 and all(a > b for a, b in itertools.pairwise(first[:10]))
    assert first[9:] == [2.0] * 11  # the run's own γ from half the steps on


def test_lambda_ramp_soft_then_binary_applies_to_dselect_k_routers_only(tmp_path: Path) -> None:
    """--entropy-reg-end with --entropy-warmup: λ stays 0 for the warm-up fraction of the steps,
    then ramps linearly from --entropy-reg to --entropy-reg-end by the last step, in every
    DSelect-k router's layers; Top-k (no λ) and the default command are unchanged."""
    from dselectk.training import Callback
    from dselectk_research.token_moe.model import train_run

    plain = TM.TokenMoEConfig(tmp_path)
    assert all(plain.variant(r) == TM.ROUTERS[r] for r in TM.ROUTERS)  # no ramp by default
    ident = plain.record_hparams()  # the defaults, stored like every setting
    assert (ident["entropy_reg_end"], ident["entropy_warmup"]) == (
        None,
        TM.DEFAULTS["entropy_warmup"],
    )
    cfg = TM.TokenMoEConfig(
        tmp_path, entropy_reg=0.0, entropy_reg_end=0.1, entropy_warmup=0.5, steps=20,
        d_model=16, d_ff=16, num_experts=4, seq_len=16, batch_size=8, val_windows=16,
    )  # fmt: skip
    assert cfg.variant("topk") == TM.ROUTERS["topk"]
    ramped = cfg.variant("dselect_k_distinct")
    assert ramped.options == TM.ROUTERS["dselect_k_distinct"].options
    assert ramped.identity()["schedules"] == [
        {"param": "entropy_reg", "end": 0.1, "delay": 0.5, "shape": "linear", "before": 0.0}
    ]
    assert cfg.record_hparams()["entropy_reg_end"] == 0.1
    seen: list[list[float]] = []

    class Watch(Callback):
        def on_step(self, model, batch, out, history):  # type: ignore[no-untyped-def]
            seen.append([float(m.gate.entropy_reg) for m in model.moe_layers])

    hp = dict(cfg.hparams(), heads=2)
    m = train_run(ramped, hp, load_corpus(40_000), 0, progress=False, desc="t", callbacks=[Watch()])
    assert math.isfinite(m["val_bpc"]) and len(seen) == 20
    assert all(len(set(s)) == 1 for s in seen)  # every layer's router on the same schedule
    lam = [s[0] for s in seen]
    assert lam[:10] == [0.0] * 10 and all(a < b for a, b in itertools.pairwise(lam[10:]))
    assert lam[-1] == pytest.approx(0.1)


def test_router_k_gives_dselect_k_routers_more_selectors_than_dispatched_experts(
    tmp_path: Path,
) -> None:
    """--router-k 3: every DSelect-k router (distinct codes too) has 3 selectors, the layer
    still dispatches k = 2 experts a token; Top-k is unchanged. The default is k + 1 (at most
    n), stored as that number; a record without one (None) means k selectors."""
    from dselectk_research.token_moe.model import build_model, train_run

    assert TM.TokenMoEConfig(tmp_path).record_hparams()["router_k"] == 3  # the default: k + 1
    assert TM.TokenMoEConfig(tmp_path, k=2, num_experts=2).record_hparams()["router_k"] == 2
    small = dict(d_model=16, d_ff=16, num_experts=4, seq_len=16, batch_size=8, val_windows=16)
    cfg = TM.TokenMoEConfig(tmp_path, router_k=3, steps=12, **small)
    assert cfg.record_hparams()["router_k"] == 3
    hp = dict(cfg.hparams(), heads=2)
    for name in ("dselect_k", "dselect_k_distinct"):
        model = build_model(cfg.variant(name), hp)
        assert all(m.gate.k == 3 and m.k == 2 for m in model.moe_layers)
    topk = build_model(cfg.variant("topk"), hp)
    assert all(m.gate.k == 2 and m.k == 2 for m in topk.moe_layers)
    plain = build_model(cfg.variant("dselect_k"), dict(hp, router_k=None))
    assert all(m.gate.k == 2 for m in plain.moe_layers)
    m = train_run(cfg.variant("dselect_k"), hp, load_corpus(40_000), 0, progress=False, desc="t")
    assert math.isfinite(m["val_bpc"]) and m["dispatched_experts_per_token"] <= 2.0
