"""``--tuned`` files whose entries would never be used, or say nothing: an empty entry, a gate
without entries, a task key that is not a task count. Each used to train with the built-in
settings while the report credited the file; each is now one line naming the file and the
entry, before any training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dselectk.cli import main
from dselectk_research.recovery.recipe import VARIANTS as REC_VARIANTS
from dselectk_research.recovery.recipe import tuned_hparams
from dselectk_research.synthetic.spec import VARIANTS, load_tuned, resolve_hparams

SYN = ["reproduce", "synthetic", "--tasks", "16", "--gates", "topk", "--reps", "1"]
SYN += ["--epochs", "1", "--n-train", "256", "--n-eval", "256", "--threads", "1", "--no-progress"]


def _write(tmp_path: Path, rec: Any) -> Path:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(rec))
    return path


@pytest.mark.parametrize(
    ("rec", "words"),
    [
        ({"hparams": {"topk": {"default": {}}}}, ["topk/default", "empty"]),
        ({"hparams": {"topk": {"16": {}}}}, ["topk/16", "empty"]),
        ({"hparams": {"topk": {}, "dselect_k": {"default": {"lr": 0.1}}}}, ["topk", "no entries"]),
        ({"hparams": {"topk": {"sixteen": {"lr": 0.05}, "default": {"lr": 0.01}}}}, ["'sixteen'"]),
        ({"hparams": {"topk": {"16.0": {"lr": 0.05}, "default": {"lr": 0.01}}}}, ["'16.0'"]),
        ({"hparams": {"topk": {"016": {"lr": 0.05}, "default": {"lr": 0.01}}}}, ["'016'"]),
        ({"hparams": {"topk": {"0": {"lr": 0.05}, "default": {"lr": 0.01}}}}, ["'0'"]),
        ({"topk/16": {"hparams": {}}}, ["topk/16", "empty"]),
        ({"topk/016": {"hparams": {"lr": 0.01}}}, ["'016'"]),
        (
            {"hparams": {"topk": {"16": {"lr": 0.01}}, "top-k": {"16": {}}}},
            ["unknown gate 'top-k'"],
        ),
    ],
)
def test_synthetic_entries_that_say_nothing_or_are_never_used_are_refused(
    tmp_path: Path, rec: Any, words: list[str]
) -> None:
    path = _write(tmp_path, rec)
    with pytest.raises(ValueError, match=r"mine\.json") as e:
        load_tuned(path)
    assert all(w in str(e.value) for w in words), e.value


def test_synthetic_good_entries_still_load_and_are_applied(tmp_path: Path) -> None:
    rec = {"hparams": {"topk": {"16": {"lr": 0.05}, "default": {"lr": 0.02, "epochs": 3}}}}
    tuned = load_tuned(_write(tmp_path, rec))
    assert resolve_hparams(VARIANTS["topk"], 16, tuned, {})["lr"] == 0.05
    assert resolve_hparams(VARIANTS["topk"], 32, tuned, {})["epochs"] == 3
    assert load_tuned()["hparams"]  # the shipped record is unaffected


def test_the_command_refuses_an_empty_entry_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSELECTK_VERIFY", "0")
    path = _write(tmp_path, {"source": "mine", "hparams": {"topk": {"default": {}}}})
    assert main([*SYN, "--tuned", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mine.json" in err and "empty" in err, err
    assert not (tmp_path / "o" / "runs").exists()


def test_recovery_empty_entry_is_refused_and_a_full_one_applied(tmp_path: Path) -> None:
    variant = REC_VARIANTS["topk"]
    with pytest.raises(ValueError, match=r"mine\.json: hparams\.topk: the entry is empty"):
        tuned_hparams(variant, _write(tmp_path, {"hparams": {"topk": {}}}))
    with pytest.raises(ValueError, match=r"mine\.json: expected \{\"hparams\""):
        tuned_hparams(variant, _write(tmp_path, {"hparams": {"topk": [1]}}))
    assert tuned_hparams(variant, _write(tmp_path, {"hparams": {"topk": {"lr": 0.3}}}))["lr"] == 0.3
