"""Member banks (dselectk.members): R members built from seeds and trained side by side equal R
runs alone; each member gets its own hyperparameters, schedules and search."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import dselectk.members as members_module
from dselectk.layers import StackedMLP
from dselectk.members import bank_loss, build_bank, per_gate_hparams, train_bank
from dselectk.models import MoEBank
from dselectk.training import Callback, History, TaskData
from dselectk.variants import Ramp, SearchPlan, Variant, stack_members

E, T, P, U = 4, 3, 5, 2
N, BATCH = 96, 32
SEEDS = [11, 12, 13]


def _data() -> TaskData:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, P, generator=g)
    y = torch.randn(N, T, generator=g)
    return TaskData(x, [y])


def _maker(v: Variant, hps: list[dict[str, Any]]) -> Any:
    """make(r): member r alone with its own hyperparameters; make(None): the bank of all."""

    def make(r: int | None) -> MoEBank:
        n = len(hps) if r is None else 1
        hp = per_gate_hparams(hps, T) if r is None else hps[r]
        experts = StackedMLP(n * E, P, [U], final_activation=True)
        return MoEBank(experts, v.build(E, hparams=hp, k=2, num_gates=n * T), members=n)

    return make


def _alone(v: Variant, hp: dict[str, Any], seed: int, **kw: Any) -> MoEBank:
    """One member trained alone: a bank of one, shared hyperparameters (torch's Adam)."""
    model = build_bank(_maker(v, [hp]), [seed])
    train_bank(model, _data(), hp, variant=v, batch_size=BATCH, shuffle_seed=5, **kw)
    return model


def _member(bank: MoEBank, r: int) -> dict[str, Tensor]:
    """Member r's parameters, shaped as a bank of one's."""
    out = {}
    for name, p in bank.named_parameters():
        rows = p.shape[0] // bank.members
        out[name] = p.detach()[r * rows : (r + 1) * rows].clone()
    return out


def test_build_bank_loads_each_member_as_built_alone_under_its_seed() -> None:
    v = Variant("dsk", "dselect_k", "DSelect-k")
    hps = [{"gamma": 1.0}, {"gamma": 2.0}, {"gamma": 4.0}]
    bank = build_bank(_maker(v, hps), SEEDS)
    assert bank.members == 3 and bank.gates.num_gates == 3 * T
    for r, s in enumerate(SEEDS):
        torch.manual_seed(s)
        alone = _maker(v, hps)(r)
        for name, p in alone.named_parameters():
            assert torch.equal(_member(bank, r)[name], p.detach()), (r, name)
    # the bank's γ: member r's over its T gates
    want = torch.tensor([1.0] * T + [2.0] * T + [4.0] * T)
    assert torch.equal(bank.gates.gamma, want)


def test_build_bank_stacks_named_buffers_and_checks_its_arguments() -> None:
    class Frozen(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(n, 2))
            self.register_buffer("table", torch.randn(n, 3))
            self.register_buffer("scale", torch.tensor(1.0))  # the bank's own

    bank = build_bank(lambda r: Frozen(1 if r is not None else 2), [4, 5], buffers=["table"])
    for r, s in enumerate([4, 5]):
        torch.manual_seed(s)
        alone = Frozen(1)
        assert torch.equal(bank.w[r], alone.w[0].detach()) and torch.equal(
            bank.table[r], alone.table[0]
        )
    with pytest.raises(ValueError, match="at least one seed"):
        build_bank(lambda r: Frozen(1), [])
    with pytest.raises(TypeError, match=r"seeds\[1\] must be an int"):
        build_bank(lambda r: Frozen(1 if r is not None else 2), [1, 2.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="no buffer 'nope'"):
        stack_members(Frozen(2), [Frozen(1), Frozen(1)], buffers=["nope"])
    with pytest.raises(ValueError, match="rows"):
        build_bank(lambda r: Frozen(1 if r is not None else 3), [1, 2], buffers=["table"])


def test_per_gate_hparams_repeats_each_members_value_over_its_gates() -> None:
    got = per_gate_hparams([{"gamma": 1.0, "lr": None}, {"gamma": 3.0}], 2)
    assert list(got) == ["gamma"]  # lr: no member sets it
    assert torch.equal(got["gamma"], torch.tensor([1.0, 1.0, 3.0, 3.0], dtype=torch.float64))
    assert per_gate_hparams([{"gamma": 1.0, "x": 2}], 1, ["x"]) == {
        "x": torch.tensor([2.0], dtype=torch.float64)
    }
    with pytest.raises(ValueError, match="member 1 has no value for 'gamma'"):
        per_gate_hparams([{"gamma": 1.0}, {}], 2)
    with pytest.raises(ValueError, match="gates_per_member"):
        per_gate_hparams([{"gamma": 1.0}], 0)
    with pytest.raises(ValueError, match="must hold numbers"):
        per_gate_hparams([{"gamma": "big"}], 1)


def test_a_bank_trains_each_member_as_it_trains_alone_with_its_own_hparams() -> None:
    """Three members, each with its own learning rate, γ and λ, equal three runs alone (to the
    rounding by which RowwiseAdam differs from torch's Adam)."""
    v = Variant("dsk", "dselect_k", "DSelect-k")
    hps = [
        {"lr": 0.05, "epochs": 3, "gamma": 1.0, "entropy_reg": 0.0},
        {"lr": 0.01, "epochs": 3, "gamma": 2.0, "entropy_reg": 0.1},
        {"lr": 0.002, "epochs": 3, "gamma": 4.0, "entropy_reg": 0.5},
    ]
    bank = build_bank(_maker(v, hps), SEEDS)
    before = {r: _member(bank, r) for r in range(3)}
    hist = train_bank(
        bank, _data(), {}, member_hparams=hps, variant=v, batch_size=BATCH, shuffle_seed=5
    )
    assert hist.steps == 3 * (N // BATCH)
    for r, (hp, s) in enumerate(zip(hps, SEEDS, strict=True)):
        alone = _alone(v, hp, s)
        mine = _member(bank, r)
        for name, p in alone.named_parameters():
            torch.testing.assert_close(mine[name], p.detach(), rtol=1e-4, atol=1e-5)
            assert not torch.equal(mine[name], before[r][name])  # it trained
    # the members moved by their own learning rates: the same update at another lr differs
    lr_swapped = build_bank(_maker(v, hps), SEEDS)
    swapped = [{**hps[0], "lr": hps[2]["lr"]}, hps[1], {**hps[2], "lr": hps[0]["lr"]}]
    train_bank(
        lr_swapped, _data(), {}, member_hparams=swapped, variant=v, batch_size=BATCH, shuffle_seed=5
    )
    assert not torch.allclose(
        _member(lr_swapped, 0)["gates.logits"], _member(bank, 0)["gates.logits"]
    )


def test_each_member_follows_its_own_schedule_and_epochs() -> None:
    """A geometric annealing of γ starts at each member's γ and ends at each member's own
    epoch count; the run lasts the largest."""
    v = Variant(
        "anneal", "dselect_k", "annealed", schedules=(Ramp("gamma", end=0.01, shape="geometric"),)
    )
    hps = [{"lr": 0.01, "epochs": 2, "gamma": 1.0}, {"lr": 0.01, "epochs": 4, "gamma": 8.0}]
    bank = build_bank(_maker(v, hps), SEEDS[:2])
    seen: dict[int, Tensor] = {}

    class Watch(Callback):
        def on_step(self, model: nn.Module, batch: Any, out: Any, history: History) -> None:
            seen[history.steps] = bank.gates.gamma

    steps_per_epoch = N // BATCH
    hist = train_bank(
        bank,
        _data(),
        {},
        member_hparams=hps,
        variant=v,
        batch_size=BATCH,
        shuffle_seed=5,
        callbacks=[Watch()],
    )
    assert hist.steps == 4 * steps_per_epoch  # the largest epochs
    g0, g1 = seen[2 * steps_per_epoch][:T], seen[2 * steps_per_epoch][T:]
    torch.testing.assert_close(g0, torch.full((T,), 0.01))  # member 0 annealed in 2 epochs
    torch.testing.assert_close(g1, torch.full((T,), (8.0 * 0.01) ** 0.5))  # half-way, geometric
    torch.testing.assert_close(seen[4 * steps_per_epoch], torch.full((2 * T,), 0.01))
    # shared hyperparameters: one schedule from the shared value
    shared = build_bank(_maker(v, [hps[0], hps[0]]), SEEDS[:2])
    seen.clear()
    bank = shared
    train_bank(
        shared, _data(), hps[0], variant=v, batch_size=BATCH, shuffle_seed=5, callbacks=[Watch()]
    )
    assert float(seen[1][0]) < 1.0 and float(seen[2 * steps_per_epoch][0]) == pytest.approx(0.01)


def test_the_search_runs_on_every_member_as_it_runs_alone() -> None:
    """With the swap search (binarizing), every member ends binary with k distinct experts per
    task, and equals its run alone (the search scores each member's gates by its own loss)."""
    plan = SearchPlan(at=(0.3, 0.8), binarize=0.5, refit=True, probe=64)
    v = Variant("dsk_search", "dselect_k", "DSelect-k + search", search=plan)
    hps = [{"lr": 0.05, "epochs": 3, "gamma": 1.0}, {"lr": 0.01, "epochs": 3, "gamma": 2.0}]
    bank = build_bank(_maker(v, hps), SEEDS[:2])
    train_bank(bank, _data(), {}, member_hparams=hps, variant=v, batch_size=BATCH, shuffle_seed=5)
    assert bool(bank.gates.is_binary().all())
    w = bank.inference_weights()  # (R, T, E)
    assert ((w > 0).sum(-1) == 2).all()
    for r, (hp, s) in enumerate(zip(hps, SEEDS[:2], strict=True)):
        alone = _alone(v, hp, s)
        torch.testing.assert_close(w[r], alone.inference_weights()[0], rtol=1e-4, atol=1e-5)


def test_a_custom_bank_takes_its_loss_and_search_loss() -> None:
    """A bank that is not a MoEBank: R linear models on a shared input, searched with the
    per-gate loss the caller gives."""

    class Lines(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.members = n
            self.w = nn.Parameter(torch.randn(n, P))
            self.gates = Variant("t", "topk", "Top-k").build(E, k=2, num_gates=n)

        def forward(self, x: Tensor) -> Tensor:  # (R, B)
            return self.w @ x.T + self.gates().weights.sum(-1, keepdim=True)

    data = _data()
    calls: list[int] = []

    def loss(model: nn.Module, batch: TaskData) -> tuple[Tensor, None]:
        return (model(batch.x) - batch.ys[0][:, 0]).square().mean(-1).sum(), None

    bank = build_bank(lambda r: Lines(1 if r is not None else 2), [1, 2])

    def per_gate() -> Tensor:
        calls.append(1)
        return (bank(data.x[:16]) - data.ys[0][:16, 0]).square().mean(-1)

    v = Variant("t_search", "topk", "Top-k + search", search=SearchPlan(at=(0.5,)))
    hp = {"lr": 0.01, "epochs": 1}
    with pytest.raises(ValueError, match="needs search_loss"):
        train_bank(bank, data, hp, variant=v, loss_fn=loss, batch_size=BATCH, shuffle_seed=0)
    with pytest.raises(ValueError, match="pass loss_fn"):
        train_bank(bank, data, hp, batch_size=BATCH, shuffle_seed=0)
    train_bank(
        bank,
        data,
        hp,
        variant=v,
        loss_fn=loss,
        search_loss=per_gate,
        batch_size=BATCH,
        shuffle_seed=0,
    )
    assert calls  # the search scored its moves with the caller's loss


def test_train_bank_rejects_bad_hyperparameters() -> None:
    v = Variant("dsk", "dselect_k", "DSelect-k")
    hps = [{"lr": 0.01, "epochs": 1}, {"lr": 0.01, "epochs": 1}]
    bank = build_bank(_maker(v, hps), SEEDS[:2])
    data = _data()
    kw: dict[str, Any] = {"batch_size": BATCH, "shuffle_seed": 0}
    with pytest.raises(ValueError, match="3 entries, the bank has 2 members"):
        train_bank(bank, data, {}, member_hparams=[*hps, hps[0]], **kw)
    with pytest.raises(ValueError, match=re.escape("member_hparams[1]: no 'lr'")):
        train_bank(bank, data, {"epochs": 1}, member_hparams=[{"lr": 0.1}, {}], **kw)
    with pytest.raises(ValueError, match="hparams: no 'epochs'"):
        train_bank(bank, data, {"lr": 0.1}, **kw)
    with pytest.raises(ValueError, match="epochs an integer"):
        train_bank(bank, data, {"lr": 0.1, "epochs": 1.5}, **kw)
    with pytest.raises(ValueError, match=r"hparams\.lr: expected a finite number"):
        train_bank(bank, data, {"lr": float("nan"), "epochs": 1}, **kw)
    with pytest.raises(ValueError, match=r"member_hparams\[0\]"):  # the variant's own check
        train_bank(
            bank,
            data,
            {},
            member_hparams=[{"lr": 0.1, "epochs": 1, "nope": 1}] * 2,
            variant=v,
            **kw,
        )
    with pytest.raises(ValueError, match="member_hparams must hold one mapping per member"):
        train_bank(bank, data, {"lr": 0.1, "epochs": 1}, member_hparams=[], **kw)
    with pytest.raises(TypeError, match="bank_loss needs a MoEBank"):
        bank_loss(nn.Linear(2, 2), data)


def test_the_modules_example_runs() -> None:
    doc = members_module.__doc__ or ""
    code = doc.split("::\n", 1)[1]
    lines = [ln[4:] if ln.startswith("    ") else ln for ln in code.splitlines()]
    namespace: dict[str, Any] = {}
    exec(compile("\n".join(lines), "members example", "exec"), namespace)
    bank = namespace["bank"]
    assert isinstance(bank, MoEBank) and bank.members == 3
    assert bool(bank.gates.is_binary().all())  # the search binarized every member
