"""Checkpoints of :func:`~dselectk.training.train`: the state a checkpoint holds (a
:class:`~dselectk.training.state.RunState` and the epoch), the configuration it carries (what
changes a run's trajectory, :func:`run_config`) and the checks on resuming it: a checkpoint
written with another configuration is a :class:`CheckpointMismatchError` listing the differing
fields (unless ``TrainConfig(resume="force")``), one that cannot be read or holds NaN/inf
weights or optimizer state a :class:`CheckpointError` naming the file."""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from dselectk.gates.hyperparameter import hyperparameters
from dselectk.training.state import RunState

if TYPE_CHECKING:
    from dselectk.training.config import TrainConfig
    from dselectk.training.tasks import TaskData

__all__ = ["CheckpointError", "CheckpointMismatchError", "data_digest"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: unreadable, not a training checkpoint, or holding
    NaN/inf weights or optimizer state (the run it saved had diverged).

    Examples:
        >>> import tempfile
        >>> from dselectk.training import TaskData, TrainConfig, train
        >>> data = TaskData(torch.randn(8, 4), [torch.randn(8, 1)])
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = Path(tmp) / "run.pt"
        ...     _ = path.write_text("not a checkpoint")
        ...     cfg = TrainConfig(epochs=1, progress=False, checkpoint=path)
        ...     try:
        ...         train(nn.Linear(4, 1), data, "mse", cfg)
        ...     except CheckpointError as e:  # any refused checkpoint
        ...         print(e)
        checkpoint ...run.pt cannot be read (...); delete it to start over
    """


class CheckpointMismatchError(CheckpointError):
    """A checkpoint was written with another training configuration than the one resuming it
    (or cannot be read at all).

    Examples:
        >>> import tempfile
        >>> from dselectk.training import TaskData, TrainConfig, train
        >>> data, model = TaskData(torch.randn(8, 4), [torch.randn(8, 1)]), nn.Linear(4, 1)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = Path(tmp) / "run.pt"
        ...     cfg = TrainConfig(epochs=1, checkpoint=path, progress=False)
        ...     hist = train(model, data, "mse", cfg)  # writes the checkpoint
        ...     cfg = TrainConfig(epochs=1, lr=0.01, checkpoint=path, progress=False)
        ...     try:  # the same run with another learning rate
        ...         train(model, data, "mse", cfg)
        ...     except CheckpointMismatchError as e:
        ...         print(e)
        checkpoint ...run.pt was written by a run with another configuration: optimizer.lr: 0.001
        in the checkpoint, 0.01 now. Delete it to start over, or pass TrainConfig(resume='force')
        to resume it anyway
    """


def _plain(v: Any) -> Any:
    """A picklable, comparable form of a configuration value (tensors as lists)."""
    if isinstance(v, Tensor):
        return v.detach().cpu().tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


_OPT_HPARAMS = (
    "lr",
    "betas",
    "eps",
    "momentum",
    "dampening",
    "nesterov",
    "weight_decay",
    "lr_decay",
    "initial_accumulator_value",
    "amsgrad",
    "maximize",
)


def _qualname(f: Any) -> str | None:
    if f is None:
        return None
    if isinstance(f, str):
        return f
    return str(getattr(f, "__qualname__", None) or type(f).__qualname__)


def run_config(
    cfg: TrainConfig,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    losses: Any,
    loss_fn: Any,
    schedulers: Sequence[Any],
    n: int,
    world: int,
    data: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    """Everything that changes the trajectory of a run (saved with its checkpoints); ``data``:
    the content digests of the training and validation data (:func:`data_digest`)."""
    hp = {k: _plain(v) for k, v in opt.defaults.items() if k in _OPT_HPARAMS}
    if "lr" not in hp and hasattr(opt, "lr"):  # e.g. RowwiseAdam's per-member rates
        hp["lr"] = _plain(opt.lr)
    if losses is None or isinstance(losses, str) or callable(losses):
        loss_names: Any = _qualname(losses)
    else:
        loss_names = [_qualname(item) for item in losses]
    return {
        "optimizer": type(opt).__qualname__,
        **{f"optimizer.{k}": v for k, v in sorted(hp.items())},
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "shuffle_seed": cfg.shuffle_seed,
        "task_weights": _plain(cfg.task_weights),
        "early_stopping_patience": cfg.early_stopping_patience,
        "losses": loss_names,
        "loss_fn": _qualname(loss_fn),
        "schedulers": [type(s).__qualname__ for s in schedulers],
        "examples": n,
        "world_size": world,
        "parameters": {k: list(v.shape) for k, v in model.state_dict().items()},
        "hyperparameters": _gate_hyperparameters(model),
        "epochs": cfg.epochs,
        "search": _search_setting(cfg.search, loss_fn),
        **({"data": data} if data is not None else {}),
    }


def _search_setting(search: Any, loss_fn: Any) -> Any:
    """``TrainConfig.search`` as a checkpoint records it: None, "auto", or the plan's fields.
    "auto" with ``loss_fn`` runs no search (the loop searches by the named losses only), so it
    is recorded as None: resuming such a run with ``search=None`` is the same run."""
    if search == "auto" and loss_fn is not None:
        return None
    if dataclasses.is_dataclass(search) and not isinstance(search, type):
        return {
            "plan": type(search).__qualname__,
            **{f.name: _plain(getattr(search, f.name)) for f in dataclasses.fields(search)},
        }
    return _plain(search)


def data_digest(data: TaskData | None) -> str | None:
    """A digest of a dataset's content (inputs and every target: shapes, dtypes and bytes), so
    that a checkpoint is never resumed on other data of the same size.

    Examples:
        >>> from dselectk.training import TaskData
        >>> x = torch.arange(12.0).view(4, 3)
        >>> digest = data_digest(TaskData(x, [x.sum(1)]))
        >>> len(digest), digest == data_digest(TaskData(x.clone(), [x.sum(1)]))  # same content
        (32, True)
        >>> data_digest(TaskData(x + 1, [x.sum(1)])) == digest  # other values, same shapes
        False
    """
    if data is None:
        return None
    h = hashlib.blake2b(digest_size=16)
    for t in (data.x, *data.ys):
        t = t.detach()
        h.update(f"{tuple(t.shape)}{t.dtype};".encode())
        if t.numel():
            h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _gate_hyperparameters(model: nn.Module) -> dict[str, Any]:
    """Every gate hyperparameter (γ, λ, τ, μ: buffers that shape training) at the start of the
    run, by ``module.name``: a checkpoint's buffers would silently replace them on resume."""
    out: dict[str, Any] = {}
    for prefix, module in model.named_modules():
        for name in hyperparameters(module):
            try:
                value = getattr(module, name)
            except AttributeError:  # declared but never set (an optional one)
                continue
            out[f"{prefix}.{name}" if prefix else name] = _round7(_plain(value))
    return out


def _round7(v: Any) -> Any:
    """Float32 buffers to the 7 digits they hold (0.01, not 0.009999999776482582)."""
    if isinstance(v, list):
        return [_round7(x) for x in v]
    return float(f"{v:.7g}") if isinstance(v, float) else v


#: keys older checkpoints carry that no longer change a run (``record_every``: the recorder
#: shorthand of TrainConfig, now a callback)
_RETIRED_KEYS = ("record_every",)


#: gate hyperparameters older checkpoints carry that the gate class no longer has, with the
#: value at which they changed nothing (DSelectK's selector-diversity μ, now DSelectKExtended's):
#: a checkpoint with that value resumes, another value is a difference
_RETIRED_HPARAMS = {"diversity": 0.0}


#: keys newer than some checkpoints: a checkpoint without them cannot be checked on them
_ADDED_KEYS = ("hyperparameters", "data", "search")


def _config_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    diffs = []
    for key in [*now, *(k for k in saved if k not in now and k not in _RETIRED_KEYS)]:
        if key in _ADDED_KEYS and key not in saved:
            continue
        a, b = saved.get(key, "<absent>"), now.get(key, "<absent>")
        if key == "hyperparameters" and isinstance(a, dict) and isinstance(b, dict):
            for name in sorted(set(a) | set(b)):
                va, vb = a.get(name, "<absent>"), b.get(name, "<absent>")
                retired = name.rsplit(".", 1)[-1]
                if vb == "<absent>" and retired in _RETIRED_HPARAMS:
                    off = _RETIRED_HPARAMS[retired]
                    if va == off or (isinstance(va, list) and all(v == off for v in va)):
                        continue
                if va != vb:
                    diffs.append(f"{name}: {va!r} in the checkpoint, {vb!r} now")
            continue
        if key == "epochs":
            if isinstance(a, int) and isinstance(b, int) and b < a:
                diffs.append(
                    f"epochs: {a} in the checkpoint, {b} now (only more epochs continue it)"
                )
        elif key == "parameters" and a != b:
            both = isinstance(a, dict) and isinstance(b, dict)
            names = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)) if both else []
            shown = ", ".join(
                f"{k} {a.get(k, 'absent')} -> {b.get(k, 'absent')}" for k in names[:3]
            )
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            diffs.append(f"parameters: {shown}{more}")
        elif key == "data" and a != b:
            a, b = a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {}
            names = [n for n in ("train_data", "val_data") if a.get(n) != b.get(n)]
            diffs.append(f"data: {' and '.join(names)} differ in content from the checkpoint's run")
        elif a != b:
            diffs.append(f"{key}: {a!r} in the checkpoint, {b!r} now")
    return diffs


def check_path(path: str | Path) -> Path:
    """``TrainConfig.checkpoint`` checked before training: not a folder, in a folder that
    exists (a ValueError naming it; a missing folder would fail only when the first epoch ends,
    its training lost)."""
    if not isinstance(path, (str, Path)) or str(path).strip() == "":
        raise ValueError(f"checkpoint must be a file path such as 'run.pt', got {path!r}")
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"checkpoint={str(path)!r} is a folder; give a file path such as run.pt")
    if not p.parent.is_dir():
        raise ValueError(f"checkpoint={str(path)!r}: the folder {str(p.parent)!r} does not exist")
    return p


def check_resumable(
    path: str | Path, saved: dict[str, Any] | None, now: dict[str, Any], resume: str
) -> None:
    """Refuse a checkpoint written with another configuration (with ``resume="force"``: warn)."""
    if saved is None:
        diffs = ["the checkpoint carries no configuration (written by an older dselectk)"]
    else:
        diffs = _config_diff(saved, now)
    if not diffs:
        return
    listing = "; ".join(diffs)
    if resume != "force":
        raise CheckpointMismatchError(
            f"checkpoint {path} was written by a run with another configuration: {listing}. "
            f"Delete it to start over, or pass TrainConfig(resume='force') to resume it anyway"
        )
    warnings.warn(
        f"resuming checkpoint {path} despite another configuration (resume='force'): {listing}",
        RuntimeWarning,
        stacklevel=5,  # the caller of train: train -> _Run.resume -> load -> here
    )


def save_state(state: RunState, epoch: int) -> dict[str, Any]:
    """The full training state of a run after 1-based ``epoch``: what a checkpoint holds."""
    return {
        "epoch": epoch,
        "config": state.config,
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "schedulers": [s.state_dict() for s in state.schedulers],
        "generator": state.generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "history": state.history,
        "best": state.best,
        "bad_epochs": state.bad_epochs,
        "best_state": state.best_state,
    }


def load(path: str | Path, state: RunState, resume: str, allow_nonfinite: bool) -> int:
    """Resume ``state`` from the checkpoint at ``path`` after checking it (readable, a training
    checkpoint, the same configuration as ``state.config``, finite unless ``allow_nonfinite``);
    the number of epochs it had finished."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated, garbled or not a torch file
        raise CheckpointMismatchError(
            f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); delete it to start over"
        ) from e
    if not isinstance(saved, dict) or "epoch" not in saved or "model" not in saved:
        raise CheckpointMismatchError(
            f"checkpoint {path} is not a training checkpoint of dselectk.train "
            "(no epoch or model state); delete it or pass another path"
        )
    check_resumable(path, saved.get("config"), state.config, resume)
    if not allow_nonfinite:
        check_finite(path, saved)
    restore(state, saved)
    return int(saved["epoch"])


def _tensors(tree: Any, prefix: str) -> Iterator[tuple[str, Tensor]]:
    """The tensors in a nested state (dicts, lists), with their paths."""
    if isinstance(tree, Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}[{i}]")


def check_finite(path: str | Path, saved: dict[str, Any]) -> None:
    """Refuse a checkpoint whose model weights, best weights or optimizer state hold NaN/inf."""
    parts = (
        ("the model's", saved.get("model")),
        ("the best weights'", saved.get("best_state")),
        ("the optimizer state's", (saved.get("optimizer") or {}).get("state")),
    )
    for what, tree in parts:
        bad = [
            name
            for name, t in _tensors(tree, "")
            if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())
        ]
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise CheckpointError(
                f"checkpoint {path}: {what} entries {', '.join(bad[:3])}{more} hold NaN/inf (the "
                f"run that wrote it had diverged); resuming it would train on nothing. Delete it "
                f"to start over (with a lower learning rate)"
            )


def restore(state: RunState, saved: dict[str, Any]) -> None:
    """Put a checkpoint's training state (see :func:`save_state`) back into ``state``."""
    state.model.load_state_dict(saved["model"])
    state.optimizer.load_state_dict(saved["optimizer"])
    for s, st in zip(state.schedulers, saved["schedulers"]):
        s.load_state_dict(st)
    state.generator.set_state(saved["generator"])
    torch.set_rng_state(saved["torch_rng"])
    state.history, state.best = saved["history"], saved["best"]
    state.bad_epochs, state.best_state = saved["bad_epochs"], saved["best_state"]
