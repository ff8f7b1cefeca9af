"""Constructor-argument checks shared by the layers, the models and the helpers around them.

Each check returns the value in its canonical type or raises a ``TypeError`` (wrong kind of
value) or ``ValueError`` (right kind, out of range) whose message names the argument and what
was expected. A string where a flag belongs is refused rather than taken for ``True``
(``bool("False")`` is ``True``), and a number must be finite.
"""

from __future__ import annotations

import difflib
import math
import numbers
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "check_choice",
    "check_flag",
    "check_input_like",
    "check_number",
    "check_sizes",
    "near_miss",
]


def check_flag(name: str, value: object, *, allow_none: bool = False) -> bool | None:
    """``value`` as a bool: a ``bool`` (or NumPy bool); None only when ``allow_none``.

    Examples:
        >>> check_flag("gated", True)
        True
        >>> check_flag("gated", "no")
        Traceback (most recent call last):
        ...
        TypeError: gated must be True or False, got the str 'no'
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy.bool_
        return bool(value)
    what = "True, False or None" if allow_none else "True or False"
    raise TypeError(f"{name} must be {what}, got the {type(value).__name__} {value!r}")


def check_number(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    open_min: bool = False,
    open_max: bool = False,
) -> float:
    """``value`` as a finite float within the bounds (``open_*``: the bound itself excluded).

    Examples:
        >>> check_number("dropout", 0.5, minimum=0.0, maximum=1.0, open_max=True)
        0.5
        >>> check_number("dropout", float("nan"), minimum=0.0)
        Traceback (most recent call last):
        ...
        ValueError: dropout must be a finite number >= 0, got nan
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if not (hasattr(value, "item") and getattr(value, "ndim", None) == 0):
            raise TypeError(f"{name} must be a number, got the {type(value).__name__} {value!r}")
        value = value.item()  # type: ignore[union-attr]  # a 0-d tensor or array
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    lo = "" if minimum is None else f"{'>' if open_min else '>='} {minimum:g}"
    hi = "" if maximum is None else f"{'<' if open_max else '<='} {maximum:g}"
    rule = " and ".join(p for p in (lo, hi) if p)
    bad = not math.isfinite(v)
    if minimum is not None and (v < minimum or (open_min and v == minimum)):
        bad = True
    if maximum is not None and (v > maximum or (open_max and v == maximum)):
        bad = True
    if bad:
        raise ValueError(f"{name} must be a finite number{' ' + rule if rule else ''}, got {v}")
    return v


def check_sizes(name: str, values: object, *, minimum: int = 1) -> tuple[int, ...]:
    """``values`` as a non-empty tuple of ints >= ``minimum`` (a list or tuple of sizes).

    Examples:
        >>> check_sizes("layer_sizes", [8, 4])
        (8, 4)
        >>> check_sizes("layer_sizes", 4)
        Traceback (most recent call last):
        ...
        TypeError: layer_sizes must be a list or tuple of ints, got the int 4
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, Iterable)):
        raise TypeError(
            f"{name} must be a list or tuple of ints, got the {type(values).__name__} {values!r}"
        )
    items = list(values)
    if not items:
        raise ValueError(f"{name} must hold at least one size, got {values!r}")
    out = []
    for i, s in enumerate(items):
        if isinstance(s, bool) or not hasattr(type(s), "__index__"):
            raise TypeError(f"{name}[{i}] must be an int, got the {type(s).__name__} {s!r}")
        s = operator.index(s)
        if s < minimum:
            raise ValueError(f"{name}[{i}] must be >= {minimum}, got {s}")
        out.append(s)
    return tuple(out)


def near_miss(value: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to ``value``, else ``""``.

    Examples:
        >>> near_miss("dselectk", ["dselect_k", "topk"])
        " (did you mean 'dselect_k'?)"
        >>> near_miss("xyz", ["dselect_k", "topk"])
        ''
    """
    pool = list(choices)
    by_key = {c.replace("_", "").replace("-", "").lower(): c for c in pool}
    key = value.replace("_", "").replace("-", "").lower()
    if key in by_key:
        return f" (did you mean {by_key[key]!r}?)"
    close = difflib.get_close_matches(value, pool, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices``, else a ValueError listing them (and the closest).

    Examples:
        >>> check_choice("routing", "token", ("token", "expert"))
        'token'
        >>> check_choice("routing", "tokens", ("token", "expert"))
        Traceback (most recent call last):
        ...
        ValueError: routing must be one of ['expert', 'token'], got 'tokens' (did you mean 'token'?)
    """
    pool = sorted(choices)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {pool}, got the {type(value).__name__} {value!r}")
    if value not in pool:
        raise ValueError(f"{name} must be one of {pool}, got {value!r}{near_miss(value, pool)}")
    return value


def _autocasting(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # older torch: no device argument
        return bool(torch.is_autocast_enabled())


def check_input_like(x: Tensor, param: Tensor, name: str = "x") -> None:
    """``x`` on ``param``'s device and (outside autocast) of its dtype: a TypeError/ValueError
    saying what to convert, instead of a matmul's error from deep inside the module (a float64
    array from NumPy into a float32 model is the common case). A ``param`` on the meta device
    (offloaded weights that a hook loads at call time) matches any device.

    Examples:
        >>> try:
        ...     check_input_like(torch.ones(2, dtype=torch.float64), torch.ones(2))
        ... except TypeError as e:
        ...     print(str(e).split(":")[0])
        x is torch.float64 but the parameters are torch.float32
    """
    # parameters on the meta device are placeholders that a hook fills at call time
    # (accelerate's offloading: ``device_map`` with "disk"/"cpu" offload): no device to match
    if x.device != param.device and param.device.type != "meta":
        raise ValueError(
            f"{name} is on {x.device} but the parameters are on {param.device}: move the input "
            f"({name}.to({str(param.device)!r})) or the model"
        )
    if x.dtype != param.dtype and not _autocasting(x.device.type):
        raise TypeError(
            f"{name} is {x.dtype} but the parameters are {param.dtype}: convert the input "
            f"({name}.to({param.dtype})) or the model (model.to({x.dtype}))"
        )
