"""Nothing silently wrong in ``train``: divergence guards, target checks, checkpoint identity."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from dselectk.gates import DSelectK, SoftmaxSelectorGate
from dselectk.layers import StackedMLP
from dselectk.models import MultiGateMoE
from dselectk.training import (
    CheckpointMismatchError,
    History,
    TaskData,
    TrainConfig,
    TrainingDivergedError,
    data_digest,
    train,
)


def make_problem(num_tasks: int = 2, n: int = 128) -> tuple[MultiGateMoE, TaskData]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    ys = [(x[:, t] * 2 + x[:, (t + 1) % 4]).unsqueeze(-1) for t in range(num_tasks)]
    torch.manual_seed(0)
    model = MultiGateMoE(
        StackedMLP(4, 4, [8], final_activation=True),
        DSelectK(4, 2, num_gates=num_tasks, gamma=2.0, entropy_reg=0.01),
        StackedMLP(num_tasks, 8, [1], activation="identity"),
    )
    return model, TaskData(x, ys)


def cfg(**kw: object) -> TrainConfig:
    return TrainConfig(**{"epochs": 2, "batch_size": 32, "progress": False, **kw})  # type: ignore[arg-type]


def finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ---------------------------------------------------------------- divergence guards


def test_nan_target_names_task_step_and_epoch() -> None:
    model, data = make_problem()
    data.ys[1][37] = math.nan  # shuffled into some batch of epoch 1
    with pytest.raises(TrainingDivergedError, match=r"step \d+ \(epoch 1\)") as info:
        train(model, data, "mse", cfg())
    err = info.value
    assert isinstance(err, FloatingPointError)
    assert err.epoch == 1 and err.tasks == [1] and 1 <= err.step <= 4
    assert f"at step {err.step} (epoch 1)" in str(err)
    assert "the loss of task 1 (ys[1]) is nan" in str(err)
    assert "targets ys[1] of this batch hold NaN/inf" in str(err)
    assert finite(model)  # the bad step was not taken


def test_inf_input_is_an_error() -> None:
    model, data = make_problem()
    data.x[5, 2] = math.inf
    with pytest.raises(TrainingDivergedError, match="inputs x of this batch hold NaN/inf"):
        train(model, data, "mse", cfg())


def test_nan_in_second_epoch_names_that_epoch() -> None:
    model, data = make_problem()

    class Poison:
        def __call__(self, m: torch.nn.Module, hist: History) -> None:
            if hist.steps == 4:  # the last step of epoch 1
                data.ys[0].fill_(math.inf)

    with pytest.raises(TrainingDivergedError, match=r"at step 5 \(epoch 2\): the loss of task 0"):
        train(model, data, "mse", cfg(), callbacks=[Poison()])


def test_huge_learning_rate_is_an_error() -> None:
    model, data = make_problem()
    with pytest.raises(TrainingDivergedError, match="lower the learning rate"):
        train(model, data, "mse", cfg(optimizer="sgd", lr=1e8, epochs=5))


def test_skip_mode_skips_counts_and_warns_once() -> None:
    model, data = make_problem()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # divergence_factor=None: only non-finite steps diverge (the exploded ones: below)
        settings = cfg(optimizer="sgd", lr=1e8, epochs=5, nonfinite="skip", divergence_factor=None)
        hist = train(model, data, "mse", settings)
    assert hist.nonfinite_steps > 0
    assert hist.steps + hist.nonfinite_steps == 5 * 4
    assert finite(model)
    msgs = [str(w.message) for w in caught if "nonfinite='skip'" in str(w.message)]
    assert len(msgs) == 1 and "training diverged at step" in msgs[0]


def test_skip_mode_skips_a_nan_batch_and_trains_on() -> None:
    model, data = make_problem()
    data.ys[0][3] = math.nan
    with pytest.warns(RuntimeWarning, match="skipping"):
        hist = train(model, data, "mse", cfg(nonfinite="skip"))
    assert hist.nonfinite_steps == 2  # one batch per epoch holds the NaN row
    assert hist.steps == 6 and finite(model)
    assert all(math.isfinite(v) for v in hist.train_loss)


def test_skip_mode_catches_nonfinite_gradients_with_finite_loss() -> None:
    model, data = make_problem()

    def loss_fn(m: torch.nn.Module, batch: TaskData) -> tuple[torch.Tensor, object]:
        out = m(batch.x)
        loss = sum(((o - y) ** 2).mean() for o, y in zip(out.outputs, batch.ys))
        # finite value, NaN gradient: sqrt'(0) * 0
        return loss + 0.0 * torch.sqrt(out.outputs[0] * 0.0).sum(), out

    with pytest.warns(RuntimeWarning, match=r"the gradients of .* are not"):
        hist = train(model, data, None, cfg(nonfinite="skip"), loss_fn=loss_fn)
    assert hist.steps == 0 and hist.nonfinite_steps == 8 and finite(model)


def test_nonfinite_gradients_raise_by_the_next_step_or_the_epoch_end() -> None:
    model, data = make_problem()

    def loss_fn(m: torch.nn.Module, batch: TaskData) -> tuple[torch.Tensor, object]:
        out = m(batch.x)
        loss = sum(((o - y) ** 2).mean() for o, y in zip(out.outputs, batch.ys))
        return loss + 0.0 * torch.sqrt(out.outputs[0] * 0.0).sum(), out

    with pytest.raises(TrainingDivergedError, match=r"gradients of .* previous step") as info:
        train(model, data, None, cfg(), loss_fn=loss_fn)
    assert info.value.step == 2
    assert "loss_fn gives only the total" in str(info.value)
    model, data = make_problem(n=32)  # one step per epoch: caught at the epoch's end
    with pytest.raises(TrainingDivergedError, match=r"parameters .* are non-finite"):
        train(model, data, None, cfg(), loss_fn=loss_fn)


def test_warnings_point_at_the_caller_of_train(tmp_path: Path) -> None:
    model, data = make_problem()
    data.ys[0][3] = math.nan
    with pytest.warns(RuntimeWarning, match="skipping") as caught:
        train(model, data, "mse", cfg(nonfinite="skip"))
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]
    ckpt = tmp_path / "run.pt"
    train(*make_problem(), "mse", cfg(checkpoint=ckpt, seed=3))
    with pytest.warns(RuntimeWarning, match="resume='force'") as caught:
        train(*make_problem(), "mse", cfg(checkpoint=ckpt, seed=4, epochs=3, resume="force"))
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]


def test_warn_mode_trains_on_like_before() -> None:
    model, data = make_problem()
    data.ys[1][37] = math.nan
    with pytest.warns(RuntimeWarning, match="training on through"):
        hist = train(model, data, "mse", cfg(nonfinite="warn"))
    assert hist.steps == 8 and hist.nonfinite_steps > 0


def test_loss_fn_divergence_says_the_task_is_unknown() -> None:
    model, data = make_problem()
    data.ys[0][:] = math.nan

    def loss_fn(m: torch.nn.Module, batch: TaskData) -> tuple[torch.Tensor, None]:
        out = m(batch.x)
        return sum(((o - y) ** 2).mean() for o, y in zip(out.outputs, batch.ys)), None

    with pytest.raises(TrainingDivergedError, match=r"step 1 .*task is not known") as info:
        train(model, data, None, cfg(), loss_fn=loss_fn)
    assert info.value.tasks == []


def test_nonfinite_and_resume_options_are_validated() -> None:
    with pytest.raises(ValueError, match="nonfinite"):
        TrainConfig(nonfinite="ignore")
    with pytest.raises(ValueError, match="resume"):
        TrainConfig(resume="yes")


# ---------------------------------------------------------------- target checks


def _classifier(classes: int) -> MultiGateMoE:
    return MultiGateMoE(
        StackedMLP(4, 4, [classes], final_activation=True), SoftmaxSelectorGate(4, 2, num_gates=1)
    )


@pytest.mark.parametrize(
    ("classes", "target", "loss", "match"),
    [
        (1, torch.randint(0, 2, (64, 1)).float(), "ce", "one class is always 0.*'bce'"),
        (3, torch.randint(0, 3, (64, 1)), "ce", r"class indices must have shape \(N,\)"),
        (3, torch.randint(0, 5, (64,)), "ce", r"must lie in \[0, 3\)"),
        (3, torch.rand(64, 1), "ce", r"class probabilities and must have shape \(N, 3\)"),
        (1, torch.randn(64, 3), "mse", r"predicts 1 value\(s\) per example.*\(N, 3\)"),
        (1, torch.randn(64, 1) * 3, "bce", r"targets in \[0, 1\]"),
    ],
)
def test_bad_targets_are_refused_naming_the_task(
    classes: int, target: torch.Tensor, loss: str, match: str
) -> None:
    x = torch.randn(64, 4)
    with pytest.raises(ValueError, match=rf"task 0 \(ys\[0\], loss '{loss}'\): .*{match}"):
        train(_classifier(classes), TaskData(x, [target]), loss, cfg(epochs=1))


def test_shape_mismatch_names_the_second_task() -> None:
    model, data = make_problem()
    data.ys[1] = torch.randn(len(data), 2)
    with pytest.raises(ValueError, match=r"task 1 \(ys\[1\], loss 'mse'\)"):
        train(model, data, "mse", cfg())


def test_valid_targets_pass() -> None:
    x = torch.randn(64, 4)
    for classes, target, loss in [
        (3, torch.randint(0, 3, (64,)), "ce"),
        (3, torch.softmax(torch.randn(64, 3), -1), "ce"),
        (1, torch.randint(0, 2, (64,)), "bce"),
        (1, torch.rand(64, 1), "bce"),
        (1, torch.randn(64), "mse"),
    ]:
        hist = train(_classifier(classes), TaskData(x, [target]), loss, cfg(epochs=1))
        assert hist.steps == 2


# ---------------------------------------------------------------- checkpoint identity


def _run(path: Path, **kw: object) -> tuple[MultiGateMoE, History]:
    model, data = make_problem()
    hist = train(model, data, "mse", cfg(checkpoint=path, **kw))
    return model, hist


def test_checkpoint_with_another_config_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "run.pt"
    _run(ckpt, seed=3, lr=0.01)
    assert not list(tmp_path.glob(".*tmp*"))
    with pytest.raises(CheckpointMismatchError) as info:
        _run(ckpt, seed=4, lr=0.02, batch_size=16)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    for field in ("seed: 3 in the checkpoint, 4 now", "optimizer.lr", "batch_size: 32"):
        assert field in msg
    assert "resume='force'" in msg
    with pytest.raises(CheckpointMismatchError, match="epochs: 2 in the checkpoint, 1 now"):
        _run(ckpt, seed=3, lr=0.01, epochs=1)
    with pytest.raises(CheckpointMismatchError, match=r"optimizer: 'Adam'.*'SGD'"):
        _run(ckpt, seed=3, lr=0.01, optimizer="sgd")
    with pytest.raises(CheckpointMismatchError, match="task_weights"):
        _run(ckpt, seed=3, lr=0.01, task_weights=[1.0, 2.0])


def test_checkpoint_with_another_search_setting_is_refused(tmp_path: Path) -> None:
    from dselectk.search import SearchPlan

    ckpt = tmp_path / "run.pt"
    _run(ckpt, search=None)
    saved = torch.load(ckpt, weights_only=False)["config"]
    assert saved["search"] is None
    with pytest.raises(CheckpointMismatchError, match="search: None in the checkpoint, 'auto' now"):
        _run(ckpt)
    plan = SearchPlan(at=(0.5,), binarize=0.25)
    with pytest.raises(CheckpointMismatchError, match=r"search: None in the checkpoint, \{'plan'"):
        _run(ckpt, search=plan)
    _run(ckpt, search=None)  # the same setting resumes
    planned = tmp_path / "plan.pt"
    _run(planned, search=plan)
    assert torch.load(planned, weights_only=False)["config"]["search"] == {
        "plan": "SearchPlan", "at": [0.5], "binarize": 0.25, "refit": False, "probe": 2048,
    }  # fmt: skip
    with pytest.raises(CheckpointMismatchError, match=r"'binarize': 0.25.*'binarize': 0.5"):
        _run(planned, search=SearchPlan(at=(0.5,), binarize=0.5))
    _run(planned, search=SearchPlan(at=(0.5,), binarize=0.25))
    # a checkpoint written before the setting was recorded resumes under any setting
    old = torch.load(planned, weights_only=False)
    del old["config"]["search"]
    torch.save(old, planned)
    _run(planned, search=None)


def test_checkpoint_of_a_dselect_k_with_the_retired_diversity_option_resumes(
    tmp_path: Path,
) -> None:
    # written when DSelectK had the diversity option: its μ in the configuration and its buffer
    # _diversity in the model state, at 0 (the default: the term was not computed)
    ckpt = tmp_path / "run.pt"
    _, hist = _run(ckpt, epochs=1, search=None)
    state = torch.load(ckpt, weights_only=False)
    (name,) = [k for k in state["config"]["hyperparameters"] if k.endswith(".gamma")]
    prefix = name[: -len("gamma")]
    for mu in (0.0, [0.0, 0.0]):
        state["config"]["hyperparameters"][prefix + "diversity"] = mu
        state["model"][prefix + "_diversity"] = torch.tensor(mu)
        torch.save(state, ckpt)
        _, hist2 = _run(ckpt, epochs=2, search=None)  # resumes: one more epoch
        assert hist2.steps == 2 * hist.steps
    # a nonzero μ trained another loss: refused
    state["config"]["hyperparameters"][prefix + "diversity"] = 0.3
    state["model"][prefix + "_diversity"] = torch.tensor(0.3)
    torch.save(state, ckpt)
    with pytest.raises(CheckpointMismatchError, match=r"diversity: 0\.3 in the checkpoint"):
        _run(ckpt, epochs=2, search=None)


def test_checkpoint_with_another_model_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "run.pt"
    _run(ckpt)
    model = MultiGateMoE(
        StackedMLP(4, 4, [16], final_activation=True),
        DSelectK(4, 2, num_gates=2),
        StackedMLP(2, 16, [1], activation="identity"),
    )
    with pytest.raises(CheckpointMismatchError, match=r"parameters: .*\[4, 4, 8\] -> \[4, 4, 16\]"):
        train(model, make_problem()[1], "mse", cfg(checkpoint=ckpt))


def test_same_config_resumes_and_more_epochs_continue(tmp_path: Path) -> None:
    ckpt = tmp_path / "run.pt"
    # the swap search is planned in fractions of the run's steps: a run given more epochs on
    # resume searches on other steps than one that had them from the start, so it is off here
    model, hist = _run(ckpt, search=None)
    again, hist2 = _run(ckpt, search=None)  # finished: nothing runs, the saved model comes back
    assert hist2.steps == hist.steps == 8 and len(hist2.train_loss) == 2
    for a, b in zip(model.parameters(), again.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref, ref_hist = _run(tmp_path / "ref.pt", epochs=4, search=None)  # uninterrupted 4 epochs
    more, hist4 = _run(ckpt, epochs=4, search=None)
    assert hist4.steps == 16 and hist4.train_loss == ref_hist.train_loss
    for a, b in zip(ref.parameters(), more.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(CheckpointMismatchError, match="epochs: 4 in the checkpoint, 2 now"):
        _run(ckpt, search=None)


def test_force_resumes_another_config_with_a_warning(tmp_path: Path) -> None:
    ckpt = tmp_path / "run.pt"
    model, _ = _run(ckpt, seed=3)
    with pytest.warns(RuntimeWarning, match="seed: 3 in the checkpoint, 4 now"):
        forced, hist = _run(ckpt, seed=4, resume="force")
    assert hist.steps == 8
    for a, b in zip(model.parameters(), forced.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpoint_without_config_needs_force(tmp_path: Path) -> None:
    ckpt = tmp_path / "old.pt"
    _run(ckpt)
    state = torch.load(ckpt, weights_only=False)
    del state["config"]
    torch.save(state, ckpt)
    with pytest.raises(CheckpointMismatchError, match="carries no configuration"):
        _run(ckpt)
    with pytest.warns(RuntimeWarning, match="carries no configuration"):
        _, hist = _run(ckpt, resume="force")
    assert hist.steps == 8


def test_checkpoint_with_a_retired_record_every_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "old.pt"
    _run(ckpt)
    state = torch.load(ckpt, weights_only=False)
    state["config"]["record_every"] = 4  # written when TrainConfig still had record_every
    torch.save(state, ckpt)
    _, hist = _run(ckpt)  # no mismatch: the recorder shorthand never changed a run
    assert hist.steps == 8


# ---------------------------------------------------------------- distributed


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, data = make_problem(n=64)
        if rank == 1:
            data.ys[0][:] = math.nan  # only rank 1's shard diverges
        try:
            train(DistributedDataParallel(model), data, "mse", cfg())
            msg = "no error"
        except TrainingDivergedError as e:
            msg = str(e)
        (Path(out_dir) / f"rank{rank}.txt").write_text(msg)
        # both ranks reach teardown before either destroys the group: destroying it while the
        # other rank's gloo work is still pending aborted a rank once in CI (SIGABRT)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_ddp_ranks_stop_together(tmp_path: Path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    r0 = (tmp_path / "rank0.txt").read_text()
    r1 = (tmp_path / "rank1.txt").read_text()
    assert r0.startswith("training diverged at step 1 (epoch 1): the loss on rank 1")
    assert r1.startswith("training diverged at step 1 (epoch 1): the loss of task 0 (ys[0]) is nan")


def test_checkpoint_with_other_gate_hyperparameters_is_refused(tmp_path: Path) -> None:
    """γ and λ are buffers: loading the checkpoint's state would silently replace the values
    of this run, so a resume with other values is refused and names them."""
    ckpt = tmp_path / "run.pt"
    _run(ckpt)
    model, data = make_problem()
    model.gates.gamma = 5.0
    model.gates.entropy_reg = [0.01, 0.5]
    with pytest.raises(CheckpointMismatchError) as info:
        train(model, data, "mse", cfg(checkpoint=ckpt))
    msg = str(info.value)
    assert "gates.gamma: 2.0 in the checkpoint, 5.0 now" in msg
    assert "gates.entropy_reg: 0.01 in the checkpoint, [0.01, 0.5] now" in msg
    # the same values resume (nothing left to train: the history is the checkpoint's)
    model, data = make_problem()
    assert train(model, data, "mse", cfg(checkpoint=ckpt)).steps == 8
    # a checkpoint written before this check (no "hyperparameters" key) still resumes
    state = torch.load(ckpt, weights_only=False)
    del state["config"]["hyperparameters"]
    torch.save(state, ckpt)
    model, data = make_problem()
    model.gates.gamma = 5.0
    train(model, data, "mse", cfg(checkpoint=ckpt))


# ---------------------------------------------------------------- checkpoint data and readability


def _other_values(data: TaskData) -> TaskData:
    """Same shapes and dtypes, one value changed."""
    x = data.x.clone()
    x[5, 1] += 1.0
    return TaskData(x, [y.clone() for y in data.ys])


def test_digest_follows_content_not_identity() -> None:
    _, data = make_problem()
    copy = TaskData(data.x.clone(), [y.clone() for y in data.ys])
    assert data_digest(copy) == data_digest(data)
    assert data_digest(_other_values(data)) != data_digest(data)
    ys = [data.ys[0].clone(), data.ys[1].clone()]
    ys[1][0] += 1e-6  # a target counts too
    assert data_digest(TaskData(data.x, ys)) != data_digest(data)
    as64 = TaskData(data.x.double(), [y.double() for y in data.ys])
    assert data_digest(as64) != data_digest(data)  # dtype counts
    assert data_digest(None) is None


def test_resume_on_other_training_data_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "run.pt"
    model, data = make_problem()
    train(model, data, "mse", cfg(checkpoint=ckpt))
    other = _other_values(data)
    with pytest.raises(CheckpointMismatchError, match="data: train_data differ in content"):
        train(make_problem()[0], other, "mse", cfg(checkpoint=ckpt, epochs=3))
    # the same content in new tensors resumes (3 epochs = the saved 2 + one more)
    same = TaskData(data.x.clone(), [y.clone() for y in data.ys])
    hist = train(make_problem()[0], same, "mse", cfg(checkpoint=ckpt, epochs=3))
    assert hist.steps == 12


def test_resume_on_other_validation_data_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "run.pt"
    model, data = make_problem()
    train(model, data, "mse", cfg(checkpoint=ckpt), val_data=data)
    with pytest.raises(CheckpointMismatchError, match="data: val_data differ"):
        train(make_problem()[0], data, "mse", cfg(checkpoint=ckpt), val_data=_other_values(data))
    with pytest.raises(CheckpointMismatchError, match="val_data"):
        train(make_problem()[0], data, "mse", cfg(checkpoint=ckpt))  # no validation now


def test_checkpoint_from_before_data_digests_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "old.pt"
    model, data = make_problem()
    train(model, data, "mse", cfg(checkpoint=ckpt))
    state = torch.load(ckpt, weights_only=False)
    del state["config"]["data"]  # written before checkpoints carried the data's digest
    torch.save(state, ckpt)
    hist = train(make_problem()[0], data, "mse", cfg(checkpoint=ckpt, epochs=3))
    assert hist.steps == 12


@pytest.mark.parametrize("content", [b"garbage", b""])
def test_unreadable_checkpoint_names_the_file(tmp_path: Path, content: bytes) -> None:
    ckpt = tmp_path / "run.pt"
    ckpt.write_bytes(content)
    model, data = make_problem()
    with pytest.raises(CheckpointMismatchError, match=r"run\.pt cannot be read"):
        train(model, data, "mse", cfg(checkpoint=ckpt))
    assert ckpt.read_bytes() == content  # left as it was


def test_a_state_dict_is_not_a_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "weights.pt"
    model, data = make_problem()
    torch.save(model.state_dict(), ckpt)
    with pytest.raises(CheckpointMismatchError, match="not a training checkpoint"):
        train(model, data, "mse", cfg(checkpoint=ckpt))


def test_val_data_with_another_task_count_is_refused() -> None:
    model, data = make_problem()
    val = TaskData(data.x, data.ys[:1])
    with pytest.raises(
        ValueError, match=r"val_data has 1 target tensor\(s\) \(ys\) but train_data has 2"
    ):
        train(model, data, "mse", cfg(), val_data=val)


def test_diverged_error_survives_pickling() -> None:
    """A worker process's error reaches the parent intact (it was a BrokenProcessPool)."""
    import pickle

    err = TrainingDivergedError("diverged at step 3", step=3, epoch=1, tasks=[0, 2])
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is TrainingDivergedError and str(back) == str(err)
    assert (back.step, back.epoch, back.tasks) == (3, 1, [0, 2])
