"""Command-line flags: run-config fields that declare their own (:func:`setting`), and argparse
types with domains, checked before any work starts: ``--reps -1`` or ``--lrs nan`` stop with one
line naming the flag and the range (exit code 2), not after a gate has trained."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from dselectk._argtypes import int_at_least as int_at_least  # re-exported for the recipes
from dselectk.gates.registry import HParam, gate_spec

__all__ = [
    "add_config_arguments",
    "add_hparam_arguments",
    "check_fits",
    "check_out_dir",
    "config_from_args",
    "existing_file",
    "file_digest",
    "fraction",
    "hparam_type",
    "int_at_least",
    "nonnegative_float",
    "out_dir",
    "positive_float",
    "probability",
    "read_json_object",
    "seed_value",
    "setting",
]

T = TypeVar("T")


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _float_type(domain: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = _float(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {domain}, got {text!r}")
        return value

    return parse


#: argparse types: a finite number > 0 (learning rates, γ), >= 0 (weights), in [0, 1], in [0, 1)
positive_float = _float_type("a finite number > 0", lambda v: v > 0)
nonnegative_float = _float_type("a finite number >= 0", lambda v: v >= 0)
probability = _float_type("a number in [0, 1]", lambda v: 0.0 <= v <= 1.0)
fraction = _float_type("a fraction in [0, 1)", lambda v: 0.0 <= v < 1.0)


#: the largest seed a flag takes: the seeds a study derives from it (init, shuffling, data) are
#: taken modulo 2**31, so a larger one would silently run the same as a smaller one
SEED_MAX = 2**31 - 1


def seed_value(text: str) -> int:
    """An argparse type: a seed, an integer in [0, :data:`SEED_MAX`] (``1e20`` or ``2**32``
    stop here with one line, instead of aliasing or overflowing in torch)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer seed in [0, {SEED_MAX}], got {text!r}"
        ) from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(
            f"expected an integer seed in [0, {SEED_MAX}] (larger seeds would alias smaller "
            f"ones), got {text}"
        )
    return value


def check_out_dir(path: str | Path) -> Path:
    """Create the results folder if needed and check that it can be written, up front (a
    ValueError when ``path`` is a file, or cannot be created or written)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path}: is a file, expected a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path, prefix=".write-check.").close()
    except OSError as e:
        raise ValueError(f"--out {path}: cannot write there ({e.strerror or e})") from None
    return path


def config_from_args(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """A recipe's frozen run config from the parsed flags: each field of the dataclass ``cls``
    takes ``values``' or the flag of its name, else its default."""
    given = {**vars(args), **values}
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    kw = {f.name: given[f.name] for f in fields if f.name in given}
    for f in fields:  # a flag of a mode that is off would be credited, never applied
        need = f.metadata.get("requires")
        default = f.metadata["flag"][1]["default"] if "flag" in f.metadata else f.default
        if need and f.name in kw and kw[f.name] != default and not kw.get(need):
            flag, switch = (f"--{n.replace('_', '-')}" for n in (f.name, need))
            raise ValueError(
                f"{flag} {kw[f.name]}: applies only with {switch} (without it the flag has no "
                f"effect); drop it or add {switch}"
            )
    # lists become tuples without repeats: the config is hashable, ``--gates topk topk`` one cell
    return cls(**{k: tuple(dict.fromkeys(v)) if isinstance(v, list) else v for k, v in kw.items()})


class HelpFormatter(argparse.HelpFormatter):
    """The help of every research command: each option that takes a value and has a default
    ends with ``(default: X)`` (unless its help says it already), lists shown as their values;
    the usage line leaves out the ``--slurm-*`` flags (their own group, "Slurm", lists them)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or action.nargs == 0
            or default is None
            or default is argparse.SUPPRESS
            or default == []
            or "default" in text
        ):
            return action.help
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, Switch):
            yes, no = action.option_strings
            return f"{yes} [true|false], {no}"
        return super()._format_action_invocation(action)

    def add_usage(self, usage: Any, actions: Any, groups: Any, prefix: Any = None) -> None:
        actions = [a for a in actions if not a.dest.startswith("slurm_")]
        super().add_usage(usage, actions, groups, prefix)


def bool_value(text: str) -> bool:
    """An argparse type: ``true``/``false`` (also 1/0, yes/no, on/off), any case."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class Switch(argparse.BooleanOptionalAction):
    """A boolean flag: ``--NAME`` / ``--no-NAME``; ``--NAME true|false`` is accepted too."""

    def __init__(self, option_strings: Any, dest: str, **kw: Any) -> None:
        kw.pop("type", None)
        super().__init__(option_strings, dest, **kw)
        self.nargs, self.metavar = "?", "true|false"

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"{option_string} takes no value")
            setattr(namespace, self.dest, False)
            return
        try:
            value = True if values is None else bool_value(values)
        except argparse.ArgumentTypeError as e:
            parser.error(f"{option_string}: {e}")
        setattr(namespace, self.dest, value)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def setting(
    default: Any,
    /,
    help: str | None = None,
    alias: str | None = None,
    requires: str | None = None,
    **kw: Any,
) -> Any:
    """A run-config field that is also the flag ``--NAME`` (and ``alias``) of
    :func:`add_config_arguments`, with argparse's ``kw`` (``type``, ``choices``...): a tuple
    takes one or more values, False makes a switch; the flag's default is the field's unless
    ``kw`` has another (None: the recipe resolves an absent flag), and ``kw`` may set another
    ``nargs`` or ``action``. ``requires``: the switch (a boolean field) without which the flag
    has no effect: :func:`config_from_args` refuses the flag with another value than its
    default when that switch is off."""
    kw = {"help": help, "default": default, **kw}
    if isinstance(default, tuple):
        kw.setdefault("nargs", "+")
    if default is False:
        kw.setdefault("action", "store_true")
    meta: dict[str, Any] = {"flag": (alias, kw)}
    if requires is not None:
        meta["requires"] = requires
    return dataclasses.field(default=default, metadata=meta)


def add_config_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per :func:`setting` of the dataclass ``cls``, in field order."""
    for f in dataclasses.fields(cls):
        if "flag" in f.metadata:
            alias, kw = f.metadata["flag"]
            p.add_argument(f"--{f.name.replace('_', '-')}", *([alias] if alias else []), **kw)


def out_dir(text: str) -> Path:
    """An argparse type: a results folder, not ``""`` (that would write into the working one)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a results folder, got an empty path")
    return Path(text)


def existing_file(text: str) -> Path:
    """An argparse type: a readable file, checked when the flags are parsed (not after loading)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file, got an empty path")
    path = Path(text)
    if not path.is_file():
        why = "is a folder, expected a file" if path.is_dir() else "no such file"
        raise argparse.ArgumentTypeError(f"{text}: {why}")
    try:
        path.open("rb").close()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: cannot read it ({e.strerror or e})") from None
    return path


def file_digest(path: str | Path) -> str:
    """The first 16 hex digits of the SHA-256 of a file's bytes (its content's identity)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def read_json_object(path: str | Path, flag: str) -> tuple[dict[str, Any], str]:
    """The JSON object in the file ``path`` given by ``flag``, and its content digest; else a
    one-line ValueError naming the flag and the file (missing, a folder, not JSON...)."""
    where = f"{flag} {path}"
    try:
        data = Path(path).read_bytes()
    except IsADirectoryError:
        raise ValueError(f"{where}: is a folder, expected a JSON file") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror or e})") from None
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj, hashlib.sha256(data).hexdigest()[:16]


def check_tuned_entry(where: str, entry: object) -> dict[str, Any]:
    """One entry of a user's tuning record (``{hyperparameter: value}``) as a dict; an empty or
    non-object entry is a ValueError naming ``where``: it would silently train with the
    built-in settings while the report credits the file."""
    if not isinstance(entry, dict):
        raise ValueError(
            f"{where}: expected an object {{hyperparameter: value}}, got {type(entry).__name__}"
        )
    if not entry:
        raise ValueError(
            f"{where}: the entry is empty (it would train with the built-in settings while "
            "the report credits the file); give its hyperparameters or remove the entry"
        )
    return dict(entry)


def check_task_key(where: str, key: object) -> str:
    """A tuning record's task-count key: ``"default"`` or a task count written as a plain
    integer >= 1 (``"16"``); anything else (``"16.0"``, ``"sixteen"``) would never be looked
    up, so it is a ValueError naming ``where``."""
    text = str(key)
    if text == "default" or (text.isdigit() and str(int(text)) == text and int(text) >= 1):
        return text
    raise ValueError(
        f'{where}: task key {text!r} is neither a task count (an integer such as "16") nor '
        '"default"; it would never be used'
    )


#: the share of the machine's memory a data set may take
MEMORY_FRACTION = 0.5


def physical_memory() -> int | None:
    """The machine's memory in bytes, or None where the platform does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def check_fits(need: float, what: str, total: int | None = None) -> None:
    """Refuse, before allocating, ``need`` bytes that scale with flags (``what``: the flags and
    values) when it exceeds :data:`MEMORY_FRACTION` of ``total`` (default the machine's)."""
    total = physical_memory() if total is None else total
    if total is None or need <= MEMORY_FRACTION * total:
        return
    gib = 2**30
    raise ValueError(
        f"{what}: about {need / gib:.1f} GiB of data, more than {MEMORY_FRACTION:.0%} of this "
        f"machine's {total / gib:.1f} GiB; lower them"
    )


def hparam_type(h: HParam) -> Callable[[str], Any]:
    """An argparse type for one declared gate hyperparameter: its type and range, from ``h``."""

    def parse(text: str) -> Any:
        value: Any = text
        if h.type is bool:
            if text.lower() not in ("true", "false"):
                raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
            value = text.lower() == "true"
        elif h.type in (int, float):
            value = _float(text)
        try:
            return h.check(value, "")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None

    return parse


def add_hparam_arguments(p: argparse.ArgumentParser, gates: Iterable[str]) -> list[str]:
    """One ``--NAME`` flag per hyperparameter the registry declares for ``gates``, typed and
    range-checked by :func:`hparam_type`, default None (the tuned value); returns their names."""
    seen: dict[str, HParam] = {}
    for name in gates:
        for h in gate_spec(name).hparams.values():
            seen.setdefault(h.name, h)
    group = p.add_argument_group("gate hyperparameters (override the tuned values)")
    for name, h in sorted(seen.items()):
        group.add_argument(
            f"--{name.replace('_', '-')}",
            type=hparam_type(h),
            default=None,
            metavar="X" if h.choices is None else "{" + ",".join(h.choices) + "}",
            help=f"{h.doc} ({h.range_text()})",
        )
    return sorted(seen)
