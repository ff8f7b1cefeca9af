"""Validated arguments and schedulable hyperparameters of the gates.

:class:`HyperParameter` keeps a value such as γ, λ or a temperature in a buffer (one value, or
one per gate of a bank); :func:`check_positive_int` and :func:`check_nonnegative` validate
constructor arguments, naming them in the errors. :mod:`dselectk.gates.base` re-exports them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, SupportsIndex, cast

import torch
from torch import Tensor, nn

__all__ = [
    "GAMMA_MIN",
    "HyperParameter",
    "check_nonnegative",
    "check_positive_int",
    "format_hyperparameter",
    "hyperparameters",
]


#: The smallest smooth-step width γ a gate takes (DSelect-k, COMET). The gradient with respect
#: to the selectors scales as 1/γ and Adam keeps its square in float32: measured on a DSelect-k
#: gate (n = 8, k = 2, a unit-scale loss, 20 Adam steps), the second moment reaches 1.4e34 at
#: γ = 1e-19 and overflows to inf at γ = 1e-22, after which the selectors stop moving without
#: an error (a loss whose gradient is 1000 times larger overflows at γ ≈ 1e-19). At 1e-10 the
#: second moment is about 1e16 for a unit-scale loss: a margin of 22 orders of magnitude.
GAMMA_MIN = 1e-10


def check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` if it is an int >= minimum, else raise a TypeError/ValueError naming it.

    Examples:
        >>> import numpy as np
        >>> from dselectk.gates.hyperparameter import check_positive_int
        >>> check_positive_int("num_experts", 8, minimum=2), check_positive_int("k", np.int64(3))
        (8, 3)
        >>> check_positive_int("k", 0)
        Traceback (most recent call last):
            ...
        ValueError: k must be >= 1, got 0
    """
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    as_int = operator.index(cast(SupportsIndex, value))  # also NumPy and 0-d integer tensors
    if as_int < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {as_int}")
    return as_int


def check_nonnegative(name: str, value: float) -> float:
    """Return ``float(value)`` if it is a finite number >= 0, else raise a ValueError naming it.

    Examples:
        >>> from dselectk.gates.hyperparameter import check_nonnegative
        >>> check_nonnegative("xi", 1)
        1.0
        >>> check_nonnegative("xi", float("inf"))
        Traceback (most recent call last):
            ...
        ValueError: xi must be a finite number >= 0, got inf
    """
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None
    if not (v >= 0.0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return v


class HyperParameter:
    """A schedulable hyperparameter of a module (γ, λ, a temperature), kept in a buffer.

    The value lives in the buffer ``_<name>``, so it follows ``.to()``, is saved in the
    ``state_dict`` (a resumed anneal continues where it was), and a schedule changing it does
    not make ``torch.compile`` recompile (it is written in place). The module's math reads the
    buffer directly.

    Two forms:

    * **scalar** (one value for the module): a 0-d buffer. Assign a number (or a 0-d tensor);
      reading returns a ``float``.
    * **per gate** (a bank, ``num_gates=T``: one value per gate): a ``(T,)`` buffer. Assign a 1-d
      tensor or a sequence of T numbers; reading returns a *new* ``(T,)`` tensor (a detached
      clone of the buffer: editing it does not change the module; assign to change the value).
      The module broadcasts the buffer over the trailing gate axis of its logits, so it works
      for static banks ``(T, ...)`` and per-example banks ``(B, T, ...)`` alike.

    Assigning a number to a per-gate hyperparameter fills every gate with it (the buffer stays
    ``(T,)``: a schedule such as :class:`~dselectk.schedules.AttributeScheduler` can drive a bank
    whose values started per gate). A tensor sets the form by its shape: a 0-d tensor makes the
    hyperparameter scalar again, a ``(T,)`` tensor per gate. Values are written in place
    (``fill_``/``copy_``, keeping the buffer's dtype and device) while the shape is unchanged; a
    change between ``()`` and ``(T,)`` registers a new buffer of the same dtype and device. A
    :class:`Gate` also accepts a ``state_dict`` whose value has the other form (it re-registers
    the buffer before loading).

    Every value is validated (finite, > 0 or >= 0); errors name the hyperparameter.

    Args:
        positive: require values > 0 (γ, temperatures) instead of >= 0 (λ, ξ).
        optional: a :class:`Gate` loads a ``state_dict`` that lacks this hyperparameter (saved
            before it existed), keeping its own value.
        minimum: values below it are refused as well (γ: see
            :data:`~dselectk.gates.dselect_k.GAMMA_MIN`).

    Examples:
        >>> from torch import nn
        >>> from dselectk.gates.hyperparameter import HyperParameter
        >>> class Bank(nn.Module):
        ...     temperature = HyperParameter(positive=True)
        ...     def __init__(self, num_gates):
        ...         super().__init__()
        ...         self.num_gates = num_gates
        ...         self.temperature = 1.0  # scalar: a 0-d buffer ``_temperature``
        >>> m = Bank(num_gates=3)
        >>> m.temperature, m._temperature.shape, list(m.state_dict())
        (1.0, torch.Size([]), ['_temperature'])
        >>> m.temperature = [0.5, 1.0, 2.0]  # one value per gate: a (T,) buffer
        >>> m.temperature.tolist(), m._temperature.shape
        ([0.5, 1.0, 2.0], torch.Size([3]))
        >>> m.temperature = 0.0
        Traceback (most recent call last):
            ...
        ValueError: temperature must be a finite number > 0, got 0.0
    """

    def __init__(self, *, positive: bool, optional: bool = False, minimum: float = 0.0) -> None:
        self.positive = positive
        self.optional = optional
        self.minimum = minimum
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @property
    def buffer_name(self) -> str:
        """Name of the buffer holding the value."""
        return f"_{self.name}"

    def __get__(self, obj: nn.Module | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        buf = getattr(obj, self.buffer_name)
        if buf.is_meta:  # no value to read: the one last assigned (see record)
            kept = self.record(obj)
            if kept is not None:
                return float(kept) if kept.dim() == 0 else kept.clone()
        if buf.dim() == 0:
            return float(buf)
        return buf.detach().clone()

    def __set__(self, obj: nn.Module, value: float | Tensor | Sequence[float]) -> None:
        buf_name = self.buffer_name
        old: Tensor | None = obj._buffers.get(buf_name)
        # Nothing here reads a buffer's value: a module built on the meta device (or under a
        # ``torch.device`` context) gets its buffers there, and the value is also kept on the
        # host (``record``) for reading on the meta device and for ``restore``.
        if isinstance(value, Tensor) and value.dim() == 0:  # shape (): one value for the module
            v = self._check_number(value.item())
            if old is None:
                obj.register_buffer(buf_name, torch.tensor(v))
            elif old.dim() == 0:
                old.fill_(v)
            else:
                obj.register_buffer(buf_name, torch.tensor(v, dtype=old.dtype, device=old.device))
            kept = torch.tensor(v, dtype=self._buffer(obj).dtype, device="cpu")
            nonzero = v != 0.0
        elif isinstance(value, Tensor) or _is_sequence(value):  # one value per gate
            t = self._per_gate_values(obj, value)
            if old is None:
                new = torch.empty(t.shape, dtype=torch.get_default_dtype())
                obj.register_buffer(buf_name, new.copy_(t))
            elif old.shape == t.shape:
                old.copy_(t)
            else:
                new = torch.empty(t.shape, dtype=old.dtype, device=old.device)
                obj.register_buffer(buf_name, new.copy_(t))
            kept = t.to(self._buffer(obj).dtype)
            nonzero = bool((t != 0).any())
        else:  # a number: today's scalar, or broadcast to every gate of a per-gate value
            v = self._check_number(value)
            if old is None:
                obj.register_buffer(buf_name, torch.tensor(v))
            else:
                old.fill_(v)
            buf = self._buffer(obj)
            kept = torch.full(buf.shape, v, dtype=buf.dtype, device="cpu")
            nonzero = v != 0.0
        _keep(obj, self.name, kept, nonzero)

    def _buffer(self, obj: nn.Module) -> Tensor:
        buf = obj._buffers[self.buffer_name]
        assert buf is not None
        return buf

    def check_state(self, value: Tensor, prefix: str = "") -> None:
        """The setter's check of a value about to be loaded from a ``state_dict``: every entry
        finite and > 0 (``positive``) or >= 0; a ValueError naming the entry otherwise."""
        if not (value.is_floating_point() or value.dtype in _INT_DTYPES):
            raise TypeError(
                f"{prefix}{self.buffer_name}: {self.name} must hold real numbers, got a "
                f"{value.dtype} tensor"
            )
        v = value.detach().to("cpu", torch.float64)
        ok = (v > 0) if self.positive else (v >= 0)
        if not bool((ok & torch.isfinite(v)).all()):
            bound = "> 0" if self.positive else ">= 0"
            shown = v.item() if v.numel() == 1 else v.tolist()
            raise ValueError(
                f"{prefix}{self.buffer_name}: {self.name} must be a finite number {bound}, "
                f"got {shown} in the state being loaded"
            )
        if v.numel():
            self._check_minimum(float(v.min()))

    def _check_number(self, value: object) -> float:
        if isinstance(value, (str, bytes, bool)):  # float("1") would accept text, bools are flags
            raise TypeError(
                f"{self.name} must be a number or one number per gate, got {type(value).__name__}"
            )
        try:
            v = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise TypeError(
                f"{self.name} must be a number or one number per gate, got {type(value).__name__}"
            ) from None
        ok = v > 0.0 if self.positive else v >= 0.0
        if not (ok and math.isfinite(v)):
            bound = "> 0" if self.positive else ">= 0"
            raise ValueError(f"{self.name} must be a finite number {bound}, got {value}")
        self._check_minimum(v)
        return v

    def _check_minimum(self, smallest: float) -> None:
        if smallest < self.minimum:
            raise ValueError(
                f"{self.name} must be >= {self.minimum:g}, got {smallest:g} (below it the "
                "gradients, which scale as 1/value, overflow the optimizer's statistics in "
                "float32 and the parameters stop moving)"
            )

    def _per_gate_values(self, obj: nn.Module, value: Any) -> Tensor:
        """Validate one value per gate and return them as a (T,) float64 CPU tensor."""
        name, bound = self.name, "> 0" if self.positive else ">= 0"
        num_gates = getattr(obj, "num_gates", None)
        if isinstance(value, Tensor):
            if not (value.is_floating_point() or value.dtype in _INT_DTYPES):
                raise TypeError(f"{name} must hold real numbers, got a {value.dtype} tensor")
            if value.is_meta:
                raise ValueError(f"{name}: a meta tensor holds no values; pass numbers")
            t = value.detach().to("cpu", torch.float64, copy=True)  # never aliases value
        else:
            try:
                t = torch.tensor([float(x) for x in value], dtype=torch.float64, device="cpu")
            except (TypeError, ValueError):
                raise TypeError(f"{name} must be a number or a sequence of numbers") from None
        if t.dim() != 1:
            raise ValueError(
                f"{name} must be a number or a 1-d tensor with one value per gate, "
                f"got shape {tuple(t.shape)}"
            )
        if num_gates is None:
            raise ValueError(
                f"{name} has {t.shape[0]} values but {type(obj).__name__} is a single gate: "
                "one value per gate needs num_gates"
            )
        if t.shape[0] != num_gates:
            raise ValueError(
                f"{name} must have one value per gate (T={num_gates}), got {t.shape[0]}"
            )
        ok = (t > 0) if self.positive else (t >= 0)
        bad = (~(ok & torch.isfinite(t))).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"{name} must be a finite number {bound} for every gate, got {t[i].item()} "
                f"(gate {i})"
            )
        self._check_minimum(float(t.min()))
        return t

    def is_per_gate(self, obj: nn.Module) -> bool:
        """Whether ``obj`` holds one value per gate (a (T,) buffer) rather than one scalar."""
        return getattr(obj, self.buffer_name).dim() > 0

    def is_nonzero(self, obj: nn.Module) -> bool:
        """Whether some value is nonzero, as of the last assignment or ``load_state_dict``.

        A Python-side flag (no device sync, a constant under ``torch.compile``), for modules
        that skip a term entirely when its weight is 0. Writing into the buffer directly
        bypasses it.
        """
        return bool(obj.__dict__.get(_NONZERO, {}).get(self.name, True))

    def refresh(self, obj: nn.Module) -> None:
        """Recompute the flags of :meth:`is_nonzero` and the :meth:`record` from the buffer
        (after an in-place load). A buffer on the meta device has no value: nothing changes."""
        buf = getattr(obj, self.buffer_name)
        if buf.is_meta:
            return
        _keep(obj, self.name, buf.detach().to("cpu", copy=True))

    def record(self, obj: nn.Module) -> Tensor | None:
        """The value last assigned (or loaded, see :meth:`refresh`), a CPU tensor of the buffer's
        shape and dtype at that time; None if never assigned. Kept off the module's tensors, so
        it survives ``to_empty`` and the meta device."""
        return cast("Tensor | None", obj.__dict__.get(_RECORD, {}).get(self.name))

    def restore(self, obj: nn.Module) -> None:
        """Write :meth:`record` back into the buffer (in place; after ``to_empty`` the buffer
        holds no meaningful value). Nothing to do when there is no record."""
        kept = self.record(obj)
        buf = getattr(obj, self.buffer_name)
        if kept is None or buf.is_meta:
            return
        if kept.shape != buf.shape:
            fresh = torch.empty(kept.shape, dtype=buf.dtype, device=buf.device)
            obj.register_buffer(self.buffer_name, fresh.copy_(kept))
        else:
            with torch.no_grad():
                buf.copy_(kept)


_NONZERO = "_hyperparameter_nonzero"
_RECORD = "_hyperparameter_record"
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _set_nonzero(obj: nn.Module, name: str, flag: bool) -> None:
    obj.__dict__.setdefault(_NONZERO, {})[name] = flag


def _keep(obj: nn.Module, name: str, value: Tensor, nonzero: bool | None = None) -> None:
    """Keep ``value`` (a CPU tensor) as the host record of ``name`` and set its nonzero flag
    (``nonzero``, or read from ``value``)."""
    obj.__dict__.setdefault(_RECORD, {})[name] = value
    _set_nonzero(obj, name, bool((value != 0).any()) if nonzero is None else nonzero)


def _is_sequence(value: object) -> bool:
    """A list/tuple of numbers, or an array with at least one dimension (e.g. numpy)."""
    if isinstance(value, (str, bytes)):
        return False
    return isinstance(value, Sequence) or getattr(value, "ndim", 0) >= 1


def hyperparameters(module: nn.Module) -> dict[str, HyperParameter]:
    """The :class:`HyperParameter` descriptors of ``module``'s class, by name.

    Examples:
        >>> from dselectk.gates import COMETGate
        >>> from dselectk.gates.hyperparameter import hyperparameters
        >>> gate = COMETGate(8, k=2, num_gates=3, gamma=[0.5, 1.0, 2.0])
        >>> sorted(hyperparameters(gate))
        ['entropy_reg', 'gamma']
        >>> hyperparameters(gate)["gamma"].is_per_gate(gate), gate.gamma.shape
        (True, torch.Size([3]))
    """
    out: dict[str, HyperParameter] = {}
    for cls in reversed(type(module).__mro__):
        for key, attr in vars(cls).items():
            if isinstance(attr, HyperParameter):
                out[key] = attr
    return out


def format_hyperparameter(value: float | Tensor) -> str:
    """``value`` as ``extra_repr`` shows it: ``0.5``, or ``[0.5, 1, 2]`` for one value per gate.

    Examples:
        >>> import torch
        >>> from dselectk.gates.hyperparameter import format_hyperparameter
        >>> format_hyperparameter(0.5), format_hyperparameter(torch.tensor([0.5, 1.0, 2.0]))
        ('0.5', '[0.5, 1, 2]')
        >>> format_hyperparameter(torch.arange(1.0, 9.0))  # a bank of 8 gates
        '[1, 2, 3, ..., 8] (8 gates)'
    """
    if not isinstance(value, Tensor):
        return f"{value:g}"
    vals = [f"{v:g}" for v in value.tolist()]
    if len(vals) > 6:
        return f"[{', '.join(vals[:3])}, ..., {vals[-1]}] ({len(vals)} gates)"
    return f"[{', '.join(vals)}]"
