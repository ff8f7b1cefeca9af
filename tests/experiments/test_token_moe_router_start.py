"""Token-MoE late router start (``--router-start F``, issue 23 screen): the routers' learning
rate is 0 for the first floor(F·steps) steps, the rest of the model trains from step 1; off by
default, and a default command's records keep their identity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dselectk.cli import main
from dselectk.data.text import load_corpus
from dselectk.experiments import token_moe as TM
from dselectk.experiments.token_moe.model import (
    make_optimizer_for,
    router_schedulers,
    router_start_step,
    train_run,
)
from dselectk.experiments.token_moe.recipe import LATER, TokenMoEConfig
from dselectk.training import Callback

_TINY = dict(d_model=16, d_ff=16, heads=2, num_experts=4, seq_len=16)


def test_off_by_default_and_recorded_only_when_set(tmp_path: Path) -> None:
    assert "router_start" in LATER and TM.DEFAULTS["router_start"] == 0.0
    assert "router_start" not in TokenMoEConfig(out=tmp_path).record_hparams()
    ident = TokenMoEConfig(out=tmp_path, router_start=0.3).record_hparams()
    assert ident["router_start"] == 0.3 and list(ident) == sorted(ident)
    hp = dict(TM.DEFAULTS, **_TINY)
    model = TM.build_model(TM.ROUTERS["topk"], hp)
    assert router_start_step(hp) == 0
    assert make_optimizer_for(model, hp) is None  # the training loop's own Adam, as before
    assert router_schedulers(None, hp) == []


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, math.nan])
def test_bad_values_are_refused_naming_the_flag(tmp_path: Path, bad: float, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="--router-start"):
        TokenMoEConfig(out=tmp_path, router_start=bad)
    with pytest.raises(SystemExit):
        main(["reproduce", "token-moe", "--out", str(tmp_path / "x"), "--router-start", str(bad)])
    assert "--router-start" in capsys.readouterr().err


@pytest.mark.parametrize("router", ["topk", "dselect_k_distinct"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_routers_sit_out_the_first_steps_then_learn(router: str, scale: float) -> None:
    hp = dict(TM.DEFAULTS, **_TINY, router_hidden=8)
    hp.update(steps=20, batch_size=8, val_windows=16, router_start=0.3, router_lr_scale=scale)
    assert router_start_step(hp) == 6
    torch.manual_seed(0)
    init = TM.build_model(TM.ROUTERS[router], hp)
    routing = {
        n for n, p in init.named_parameters() if any(p is q for q in init.router_parameters())
    }
    assert routing and any(n.endswith("router_input.0.weight") for n in routing)
    start = {n: p.detach().clone() for n, p in init.named_parameters()}
    moved: list[tuple[bool, bool]] = []  # per step: (a router moved, the rest moved)
    last = dict(start)

    class Watch(Callback):
        def on_step(self, model, batch, out, history):  # type: ignore[no-untyped-def]
            now = {n: p.detach().clone() for n, p in model.named_parameters()}
            r = any(not torch.equal(now[n], last[n]) for n in routing)
            rest = any(not torch.equal(now[n], last[n]) for n in now if n not in routing)
            moved.append((r, rest))
            last.update(now)

    m = train_run(
        TM.ROUTERS[router], hp, load_corpus(40_000), 0, progress=False, desc="t",
        callbacks=[Watch()],
    )  # fmt: skip
    assert math.isfinite(m["val_bpc"]) and len(moved) == 20
    assert [r for r, _ in moved] == [False] * 6 + [True] * 14  # frozen for floor(0.3·20) steps
    assert all(rest for _, rest in moved)  # the rest of the model trains from step 1


def test_the_routers_group_lr_is_zero_then_scaled() -> None:
    hp = dict(TM.DEFAULTS, **_TINY, steps=10 * 3 + 10, router_start=0.25, router_lr_scale=0.5)
    model = TM.build_model(TM.ROUTERS["dselect_k_distinct"], hp)
    opt = make_optimizer_for(model, hp)
    (sched,) = router_schedulers(opt, hp)
    assert opt is not None
    seen = []
    for _ in range(hp["steps"]):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()  # no gradients: nothing moves, the schedule runs
        sched.step()
    assert seen[:10] == [[2e-3, 0.0]] * 10 and seen[10:] == [[2e-3, 1e-3]] * 30
    with pytest.raises(ValueError, match="router_start"):
        router_schedulers(None, hp)


def test_cli_records_router_start(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert main(["reproduce", "token-moe", "--seeds", "1", "--steps", "12", "--batch-size", "4",
                 "--d-model", "16", "--d-ff", "16", "--num-experts", "4", "--corpus-bytes",
                 "40000", "--seq-len", "16", "--val-windows", "8", "--jobs", "1",
                 "--no-progress", "--gates", "topk", "--router-start", "0.5",
                 "--out", str(out)]) == 0  # fmt: skip
    (rec,) = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert rec["config"]["hparams"]["router_start"] == 0.5
    assert "router_lr_scale" not in rec["config"]["hparams"]
