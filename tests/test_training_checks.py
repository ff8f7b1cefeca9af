"""Bad data and runs that blow up: TaskData's types, validation data checked before training,
divergence beyond non-finite losses, non-finite validation losses, and checkpoints of a diverged
run refused on resume."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dselectk.gates import DSelectK
from dselectk.layers import StackedMLP
from dselectk.models import MultiGateMoE, MultiTaskOutput
from dselectk.training import (
    DIVERGENCE_FACTOR,
    CheckpointError,
    TaskData,
    TrainConfig,
    TrainingDivergedError,
    evaluate,
    loss_diverged,
    train,
)


def make_problem(n: int = 128) -> tuple[MultiGateMoE, TaskData]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    ys = [(x[:, t] * 2 + x[:, (t + 1) % 4]).unsqueeze(-1) for t in range(2)]
    torch.manual_seed(0)
    model = MultiGateMoE(
        StackedMLP(4, 4, [8], final_activation=True),
        DSelectK(4, 2, num_gates=2, gamma=2.0, entropy_reg=0.01),
        StackedMLP(2, 8, [1], activation="identity"),
    )
    return model, TaskData(x, ys)


def cfg(**kw: object) -> TrainConfig:
    return TrainConfig(**{"epochs": 2, "batch_size": 32, "progress": False, **kw})  # type: ignore[arg-type]


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------- TaskData


def test_taskdata_with_a_tensor_for_the_target_list_says_what_it_expects() -> None:
    x = torch.randn(8, 3)
    with pytest.raises(
        TypeError, match=r"ys must be a list of target tensors.*TaskData\(x, \[y\]\)"
    ):
        TaskData(x, x[:, 0])
    with pytest.raises(TypeError, match="ys must be a list"):
        TaskData(x, {"a": x})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ys\[1\] must be a Tensor"):
        TaskData(x, [x[:, 0], [1.0] * 8])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="x must be a Tensor"):
        TaskData(x.tolist(), [x[:, 0]])  # type: ignore[arg-type]
    data = TaskData(x, (x[:, 0], x[:, 1]))  # a tuple is a list
    assert isinstance(data.ys, list) and len(data.ys) == 2


# ---------------------------------------------------------------- validation data


@pytest.mark.parametrize(
    ("field", "where"),
    [("x", "inputs"), ("ys[1]", "targets of task 1"), ("ys[0]", "targets of task 0")],
)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_validation_data_is_refused_before_training(
    field: str, where: str, bad: float
) -> None:
    model, data = make_problem()
    _, val = make_problem(40)
    tensor = val.x if field == "x" else val.ys[int(field[3])]
    tensor[7, 0] = bad
    before = params(model)
    with pytest.raises(
        ValueError,
        match=re.escape(f"val_data.{field} (the {where}") + r".*1 NaN/inf.*example 7",
    ):
        train(model, data, "mse", cfg(early_stopping_patience=2), val_data=val)
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))  # nothing trained


def test_empty_validation_data_is_a_clear_error() -> None:
    model, data = make_problem()
    empty = TaskData(data.x[:0], [y[:0] for y in data.ys])
    with pytest.raises(ValueError, match="val_data has no examples"):
        train(model, data, "mse", cfg(early_stopping_patience=2), val_data=empty)
    with pytest.raises(ValueError, match="data has no examples"):
        evaluate(model, empty, "mse")


def test_validation_targets_are_checked_against_the_model() -> None:
    model, data = make_problem()
    _, val = make_problem(40)
    val.ys[1] = torch.randn(40, 3)  # 3 values per example, the model predicts 1
    with pytest.raises(ValueError, match=r"task 1 \(ys\[1\], loss 'mse'\).*predicts 1 value"):
        train(model, data, "mse", cfg(), val_data=val)


class _NaNWhenEvaluated(nn.Module):
    """A model whose outputs are NaN in eval mode (finite data, a diverged validation)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> MultiTaskOutput:
        out = self.inner(x)
        if self.training:
            return out
        return out._replace(outputs=[o * math.nan for o in out.outputs])


def test_a_nonfinite_validation_loss_diverges() -> None:
    model, data = make_problem()
    with pytest.raises(
        TrainingDivergedError, match=r"epoch 1 .*validation loss of task\(s\) \[0, 1\]"
    ):
        train(_NaNWhenEvaluated(model), data, "mse", cfg(), val_data=data)


def test_early_stopping_never_stops_silently_without_a_best_epoch() -> None:
    model, data = make_problem()
    with pytest.warns(RuntimeWarning, match="no best epoch.*keeps its last weights"):
        hist = train(
            _NaNWhenEvaluated(model),
            data,
            "mse",
            cfg(epochs=5, early_stopping_patience=2, nonfinite="warn"),
            val_data=data,
        )
    assert hist.stopped_early and hist.best_epoch is None
    assert hist.nonfinite_val_epochs == 2 and hist.diverged


# ---------------------------------------------------------------- divergence beyond NaN


def test_loss_diverged_rule() -> None:
    assert DIVERGENCE_FACTOR == 1e6
    assert loss_diverged(math.nan, 1.0) and loss_diverged(math.inf, None)
    assert loss_diverged(-math.inf, 5.0, None)
    assert not loss_diverged(1e6, 1.0) and loss_diverged(1.0001e6, 1.0)
    assert not loss_diverged(1e6, 0.0) and loss_diverged(2e6, -1e-9)  # scale at least 1
    assert not loss_diverged(2e8, -300.0) and loss_diverged(4e8, -300.0)  # |first| scales
    assert not loss_diverged(1e300, 1.0, None)  # no factor: only non-finite diverges
    assert not loss_diverged(1e300, None)  # first loss unknown yet


def test_an_exploding_loss_diverges_before_it_overflows() -> None:
    model, data = make_problem()
    with pytest.raises(
        TrainingDivergedError, match=r"above 1e\+06 x max\(\|first loss\|, 1\)"
    ) as e:
        train(model, data, "mse", cfg(optimizer="sgd", lr=1e8, epochs=5))
    assert e.value.step == 2 and e.value.epoch == 1


def test_exploded_steps_are_counted_when_training_on() -> None:
    model, data = make_problem()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hist = train(model, data, "mse", cfg(optimizer="sgd", lr=1e8, epochs=5, nonfinite="skip"))
    assert hist.exploded_steps > 0 and hist.diverged
    assert hist.steps + hist.exploded_steps + hist.nonfinite_steps == 5 * 4
    assert hist.first_loss is not None and math.isfinite(hist.first_loss)
    assert sum("nonfinite='skip'" in str(w.message) for w in caught) == 1


def test_a_healthy_run_is_not_diverged_and_keeps_its_first_loss() -> None:
    model, data = make_problem()
    hist = train(model, data, "mse", cfg(batch_size=len(data), epochs=3))
    assert not hist.diverged and hist.exploded_steps == hist.nonfinite_steps == 0
    assert hist.first_loss == pytest.approx(hist.train_loss[0])
    assert hist.train_loss[-1] < hist.train_loss[0]


def test_divergence_factor_is_checked() -> None:
    for bad in (0.5, 1.0, math.nan, math.inf, "big", True):
        with pytest.raises(ValueError, match="divergence_factor must be a finite number > 1"):
            cfg(divergence_factor=bad)


# ---------------------------------------------------------------- checkpoints of a diverged run


@pytest.mark.parametrize("part", ["model", "optimizer"])
def test_resuming_a_nonfinite_checkpoint_is_refused(tmp_path: Path, part: str) -> None:
    path = tmp_path / "run.pt"
    train(*make_problem(), "mse", cfg(checkpoint=path))
    saved = torch.load(path, weights_only=False)
    if part == "model":
        next(iter(saved["model"].values())).view(-1)[0] = math.nan
    else:
        state = next(iter(saved["optimizer"]["state"].values()))
        state["exp_avg_sq"].view(-1)[0] = math.inf
    torch.save(saved, path)
    model, data = make_problem()
    before = params(model)
    with pytest.raises(
        CheckpointError, match=rf"checkpoint {path}: the {part}('s| state's) .*NaN/inf"
    ):
        train(model, data, "mse", cfg(checkpoint=path, epochs=3))
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))
    # a run that trains on through diverged members (nonfinite="warn") resumes it
    train(model, data, "mse", cfg(checkpoint=path, epochs=3, nonfinite="warn"))


# ---------------------------------------------------------------- threads


def test_threads_auto_trains_small_steps_on_one_thread_and_restores() -> None:
    from dselectk.training.config import PARALLEL_MIN_WORK, train_threads

    seen: list[int] = []
    model, data = make_problem()
    before = torch.get_num_threads()
    hist = train(
        model, data, "mse", cfg(), callbacks=[lambda m, h: seen.append(torch.get_num_threads())]
    )
    assert set(seen) == {1} and torch.get_num_threads() == before and hist.steps == 8
    params = sum(p.numel() for p in model.parameters())
    assert train_threads(cfg(), model) == 1  # 32 x params is small
    big = cfg(batch_size=PARALLEL_MIN_WORK // params + 1)
    assert train_threads(big, model) is None  # torch's own count
    assert train_threads(cfg(threads=3), model) == 3
    assert train_threads(cfg(threads=None), model) is None
    seen.clear()
    train(
        model,
        data,
        "mse",
        cfg(threads=None),
        callbacks=[lambda m, h: seen.append(torch.get_num_threads())],
    )
    assert set(seen) == {before}
    for bad in (0, -1, 1.5, "many"):
        with pytest.raises((ValueError, TypeError), match="threads"):
            cfg(threads=bad)
