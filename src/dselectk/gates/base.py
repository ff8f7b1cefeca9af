"""The contract every gate follows.

A gate maps an input (or nothing, for a static gate) to expert weights. One class serves both
settings of the paper: with ``in_features=None`` the gate is *static* (its logits are
parameters, Section 3.1); with ``in_features=p`` it is *per-example* (its logits are an affine
function of the input, Section 3.2). With ``num_gates=T`` a single module holds the gates of T
tasks and computes them together in one batched op (multi-gate MoE, Figure 1 right).

Output shapes (n experts):

=================  ==================  =====================
                   ``num_gates=None``  ``num_gates=T``
=================  ==================  =====================
static             (n,)                (T, n)
per-example        (B, n)              (B, T, n)
=================  ==================  =====================

Per-example gates also accept tokens: an input of shape ``(..., p)`` (e.g. ``(B, S, p)``, a
batch of sequences) is flattened to ``(N, p)`` with N the product of the leading dims, gated as N
examples, and the weights are reshaped to ``(..., n)`` or ``(..., T, n)``; auxiliary losses are
averaged over the N tokens. A ``(B, p)`` input takes exactly the path it always took.

``forward`` is pure: it returns the weights and the auxiliary loss (entropy terms, penalties,
balancing losses) in a :class:`GateOutput`; nothing is stored on the module and nothing calls
``backward``. Per-example auxiliary losses are averaged over the batch, so their weight does not
depend on the batch size; losses of the T gates of a bank are summed (one term per task, as
when each task's gate adds its own regulariser to a summed multi-task loss).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple, SupportsIndex, cast

import torch
from torch import Tensor, nn

__all__ = [
    "Gate",
    "GateOutput",
    "HyperParameter",
    "check_nonnegative",
    "check_positive_int",
    "format_hyperparameter",
    "hyperparameters",
]


class GateOutput(NamedTuple):
    """What a gate's forward returns."""

    weights: Tensor
    """Expert weights, shape as in the table of :mod:`dselectk.gates.base`."""
    aux_loss: Tensor
    """Scalar to add to the training loss (already multiplied by its weights λ, ξ, ...)."""


def check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` if it is an int >= minimum, else raise a TypeError/ValueError naming it."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    as_int = operator.index(cast(SupportsIndex, value))  # also NumPy and 0-d integer tensors
    if as_int < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {as_int}")
    return as_int


def check_nonnegative(name: str, value: float) -> float:
    """Return ``float(value)`` if it is a finite number >= 0, else raise a ValueError naming it."""
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
    """

    def __init__(self, *, positive: bool, optional: bool = False) -> None:
        self.positive = positive
        self.optional = optional
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
        if buf.dim() == 0:
            return float(buf)
        return buf.detach().clone()

    def __set__(self, obj: nn.Module, value: float | Tensor | Sequence[float]) -> None:
        buf_name = self.buffer_name
        old: Tensor | None = obj._buffers.get(buf_name)
        if isinstance(value, Tensor) and value.dim() == 0:  # shape (): one value for the module
            v = self._check_number(value.item())
            if old is None:
                obj.register_buffer(buf_name, torch.tensor(v))
            elif old.dim() == 0:
                old.fill_(v)
            else:
                obj.register_buffer(buf_name, torch.tensor(v, dtype=old.dtype, device=old.device))
            nonzero = v != 0.0
        elif isinstance(value, Tensor) or _is_sequence(value):  # one value per gate
            t = self._per_gate_values(obj, value)
            if old is None:
                obj.register_buffer(buf_name, t.to(torch.get_default_dtype()))
            elif old.shape == t.shape:
                old.copy_(t)
            else:
                new = torch.empty(t.shape, dtype=old.dtype, device=old.device)
                obj.register_buffer(buf_name, new.copy_(t))
            nonzero = bool((t != 0).any())
        else:  # a number: today's scalar, or broadcast to every gate of a per-gate value
            v = self._check_number(value)
            if old is None:
                obj.register_buffer(buf_name, torch.tensor(v))
            else:
                old.fill_(v)
            nonzero = v != 0.0
        _set_nonzero(obj, self.name, nonzero)

    def _check_number(self, value: object) -> float:
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
        return v

    def _per_gate_values(self, obj: nn.Module, value: Any) -> Tensor:
        """Validate one value per gate and return them as a (T,) float64 CPU tensor."""
        name, bound = self.name, "> 0" if self.positive else ">= 0"
        num_gates = getattr(obj, "num_gates", None)
        if isinstance(value, Tensor):
            if not (value.is_floating_point() or value.dtype in _INT_DTYPES):
                raise TypeError(f"{name} must hold real numbers, got a {value.dtype} tensor")
            t = value.detach().to("cpu", torch.float64, copy=True)  # never aliases value
        else:
            try:
                t = torch.tensor([float(x) for x in value], dtype=torch.float64)
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
        """Recompute the flags of :meth:`is_nonzero` from the buffer (after an in-place load)."""
        _set_nonzero(obj, self.name, bool((getattr(obj, self.buffer_name) != 0).any()))


_NONZERO = "_hyperparameter_nonzero"
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _set_nonzero(obj: nn.Module, name: str, flag: bool) -> None:
    obj.__dict__.setdefault(_NONZERO, {})[name] = flag


def _is_sequence(value: object) -> bool:
    """A list/tuple of numbers, or an array with at least one dimension (e.g. numpy)."""
    if isinstance(value, (str, bytes)):
        return False
    return isinstance(value, Sequence) or getattr(value, "ndim", 0) >= 1


def hyperparameters(module: nn.Module) -> dict[str, HyperParameter]:
    """The :class:`HyperParameter` descriptors of ``module``'s class, by name."""
    out: dict[str, HyperParameter] = {}
    for cls in reversed(type(module).__mro__):
        for key, attr in vars(cls).items():
            if isinstance(attr, HyperParameter):
                out[key] = attr
    return out


def format_hyperparameter(value: float | Tensor) -> str:
    """``value`` as ``extra_repr`` shows it: ``0.5``, or ``[0.5, 1, 2]`` for one value per gate."""
    if not isinstance(value, Tensor):
        return f"{value:g}"
    vals = [f"{v:g}" for v in value.tolist()]
    if len(vals) > 6:
        return f"[{', '.join(vals[:3])}, ..., {vals[-1]}] ({len(vals)} gates)"
    return f"[{', '.join(vals)}]"


class Gate(nn.Module):
    """Base class: parameter layout (static or per-example, single or bank) and input checks.

    Subclasses declare how many logits each gate needs (``_logit_shape``) and implement
    :meth:`gate` on the logits, which have shape ``(*lead, *logit_shape)`` with ``lead`` one of
    (), (T,), (B,), (B, T).

    Args:
        num_experts: n >= 2.
        in_features: input size p of a per-example gate, or None for a static gate.
        num_gates: number of gates held by this module (one per task), or None for one gate.
        bias: whether a per-example gate's affine map has a bias.
        check_finite: raise a ValueError on NaN/inf inputs (costs a device sync per call).
    """

    #: whether outputs are promised to lie on the probability simplex
    on_simplex: bool = True
    #: at most this many nonzeros per output (None: no promise); set by sparse gates
    max_nonzeros: int | None = None

    def __init__(
        self,
        num_experts: int,
        *,
        in_features: int | None = None,
        num_gates: int | None = None,
        bias: bool = True,
        check_finite: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = check_positive_int("num_experts", num_experts, 2)
        self.in_features = (
            None if in_features is None else check_positive_int("in_features", in_features)
        )
        self.num_gates = None if num_gates is None else check_positive_int("num_gates", num_gates)
        self.check_finite = bool(check_finite)
        self._bias = bool(bias)

    def _set_k(self, k: object) -> int:
        """Validate and store ``k``, the number of experts a sparse gate selects (1 <= k <= n)."""
        self.k = check_positive_int("k", k)
        if self.k > self.num_experts:
            raise ValueError(f"k must be <= num_experts ({self.num_experts}), got {k}")
        return self.k

    # -- layout ---------------------------------------------------------------------------
    @property
    def static(self) -> bool:
        """True for a static gate (weights do not depend on the input)."""
        return self.in_features is None

    def _logit_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _build_logits(self, init: nn.Module | None = None) -> None:
        """Create the logit source: a parameter (static) or a fused linear layer (per-example)."""
        shape = self._logit_shape()
        size = math.prod(shape)
        g = 1 if self.num_gates is None else self.num_gates
        if self.static:
            lead = () if self.num_gates is None else (self.num_gates,)
            self.logits = nn.Parameter(torch.zeros(*lead, *shape))
            self.proj: nn.Linear | None = None
        else:
            assert self.in_features is not None  # for mypy; checked in __init__
            self.proj = nn.Linear(self.in_features, g * size, bias=self._bias)
            self.register_parameter("logits", None)

    def compute_logits(self, x: Tensor | None = None) -> Tensor:
        """Logits of shape ``(*lead, *logit_shape)`` for input ``x`` (ignored by static gates).

        A per-example input ``(..., p)`` with more than one leading dim is flattened first: the
        logits are then ``(N, [T,] *logit_shape)``, N the number of tokens.
        """
        shape = self._logit_shape()
        if self.static:
            return self.logits
        x = self._flatten_tokens(self._check_input(x))
        assert self.proj is not None
        out = self.proj(x)  # (B, G * size): one matmul for all gates and all parameter groups
        lead = (x.shape[0],) if self.num_gates is None else (x.shape[0], self.num_gates)
        return out.view(*lead, *shape)

    def _check_input(self, x: Tensor | None) -> Tensor:
        if x is None:
            raise ValueError(f"{type(self).__name__} is per-example: forward needs an input x")
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"x must have shape (batch, {self.in_features}) or (..., {self.in_features}) "
                f"(tokens), got {tuple(x.shape)}"
            )
        if self.check_finite and not torch.isfinite(x).all():
            raise ValueError("x contains NaN or inf (check_finite=True)")
        return x

    @staticmethod
    def _flatten_tokens(x: Tensor) -> Tensor:
        """``(..., p)`` tokens as ``(N, p)`` rows; a ``(B, p)`` input is returned as is."""
        return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])

    def __call__(self, x: Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        # Tokens (..., p) of a per-example gate: gate the flattened (N, p) rows (every
        # subclass's forward sees the (B, p) input it always saw), then give the weights back
        # their leading dims. Everything else, (B, p) included, is the plain module call.
        if self.static or not isinstance(x, Tensor) or x.dim() <= 2:
            return super().__call__(x, *args, **kwargs)
        lead = x.shape[:-1]
        out = super().__call__(self._check_input(x).reshape(-1, x.shape[-1]), *args, **kwargs)
        return GateOutput(out.weights.reshape(*lead, *out.weights.shape[1:]), out.aux_loss)

    # -- interface ------------------------------------------------------------------------
    def forward(self, x: Tensor | None = None) -> GateOutput:
        """Expert weights and auxiliary loss for input ``x`` (None for a static gate)."""
        return self.gate(self.compute_logits(x))

    def gate(self, logits: Tensor) -> GateOutput:
        """The gate's math on precomputed logits."""
        raise NotImplementedError

    def _reduce_aux(self, per_gate: Tensor) -> Tensor:
        """Sum an auxiliary loss over gates and average it over the batch.

        Args:
            per_gate: (*lead,) loss of each gate (and example).
        """
        if self.static:
            return per_gate.sum()
        if not torch.jit.is_tracing() and per_gate.shape[0] == 0:
            return per_gate.sum()  # an empty batch: 0, not 0 / 0
        return per_gate.sum() / per_gate.shape[0]

    @staticmethod
    def _per_gate(value: Tensor, trailing: int) -> Tensor:
        """A hyperparameter buffer shaped to broadcast against ``(*lead, *rest)`` tensors.

        A 0-d buffer (one value) is returned as is; a (T,) buffer (one value per gate) gets
        ``trailing`` singleton dims, so it lines up with the trailing gate axis of a static bank
        ``(T, *rest)`` and of a per-example bank ``(B, T, *rest)`` (``len(rest) == trailing``).
        """
        if value.dim() == 0:
            return value
        return value.view(-1, *([1] * trailing))

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # A hyperparameter saved in the other form (one value vs one per gate) replaces the
        # buffer's shape, as assigning it would; other mismatches are left to torch's checks.
        hps = hyperparameters(self).values()
        for hp in hps:
            old, new = self._buffers.get(hp.buffer_name), state_dict.get(prefix + hp.buffer_name)
            if not (isinstance(old, Tensor) and isinstance(new, Tensor)) or new.shape == old.shape:
                continue
            if new.dim() == 0 or tuple(new.shape) == (self.num_gates,):
                fresh = torch.empty(new.shape, dtype=old.dtype, device=old.device)
                fresh.copy_(new.detach())  # (also copied below; never left uninitialised)
                self.register_buffer(hp.buffer_name, fresh)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        for hp in hps:
            key = prefix + hp.buffer_name
            if key in state_dict and hp.buffer_name in self._buffers:
                hp.refresh(self)
            elif hp.optional and key in missing_keys:
                missing_keys.remove(key)

    # -- introspection --------------------------------------------------------------------
    @torch.no_grad()
    def expert_weights(self, x: Tensor | None = None) -> Tensor:
        """The expert weights, without gradients."""
        return self(x).weights

    @torch.no_grad()
    def selected_experts(self, x: Tensor | None = None) -> Tensor:
        """Boolean mask of the experts with a nonzero weight, shaped like the weights."""
        return self.expert_weights(x) > 0

    @torch.no_grad()
    def num_selected(self, x: Tensor | None = None) -> Tensor:
        """Number of experts with a nonzero weight: per gate (static) or per example."""
        return self.selected_experts(x).sum(dim=-1)

    def extra_repr(self) -> str:
        kind = "static" if self.static else f"in_features={self.in_features}"
        gates = "" if self.num_gates is None else f", num_gates={self.num_gates}"
        return f"num_experts={self.num_experts}, {kind}{gates}"
