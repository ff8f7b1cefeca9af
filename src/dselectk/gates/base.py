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

``forward`` is pure: it returns the weights and the auxiliary loss (entropy terms, penalties,
balancing losses) in a :class:`GateOutput`; nothing is stored on the module and nothing calls
``backward``. Per-example auxiliary losses are averaged over the batch, so their weight does not
depend on the batch size; losses of the T gates of a bank are summed (one term per task, as
when each task's gate adds its own regulariser to a summed multi-task loss).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["Gate", "GateOutput", "HyperParameter", "check_nonnegative", "check_positive_int"]


class GateOutput(NamedTuple):
    """What a gate's forward returns."""

    weights: Tensor
    """Expert weights, shape as in the table of :mod:`dselectk.gates.base`."""
    aux_loss: Tensor
    """Scalar to add to the training loss (already multiplied by its weights λ, ξ, ...)."""


def check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` if it is an int >= minimum, else raise a TypeError/ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


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
    """A schedulable float hyperparameter of a module (γ, λ, a temperature), kept in a 0-d buffer.

    Reading gives a float; assigning validates the value and writes it into the buffer
    ``_<name>`` in place. So the value follows ``.to()``, is saved in the ``state_dict`` (a
    resumed anneal continues where it was), and a schedule changing it does not make
    ``torch.compile`` recompile. The module's math reads the buffer directly.

    Args:
        positive: require a value > 0 (γ, temperatures) instead of >= 0 (λ, ξ).
    """

    def __init__(self, *, positive: bool) -> None:
        self.positive = positive
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: nn.Module | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return float(getattr(obj, f"_{self.name}"))

    def __set__(self, obj: nn.Module, value: float) -> None:
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"{self.name} must be a number, got {type(value).__name__}") from None
        ok = v > 0.0 if self.positive else v >= 0.0
        if not (ok and math.isfinite(v)):
            bound = "> 0" if self.positive else ">= 0"
            raise ValueError(f"{self.name} must be a finite number {bound}, got {value}")
        buf = f"_{self.name}"
        if buf in obj._buffers:
            getattr(obj, buf).fill_(v)
        else:
            obj.register_buffer(buf, torch.tensor(v))


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
        """Logits of shape ``(*lead, *logit_shape)`` for input ``x`` (ignored by static gates)."""
        shape = self._logit_shape()
        if self.static:
            return self.logits
        x = self._check_input(x)
        assert self.proj is not None
        out = self.proj(x)  # (B, G * size): one matmul for all gates and all parameter groups
        lead = (x.shape[0],) if self.num_gates is None else (x.shape[0], self.num_gates)
        return out.view(*lead, *shape)

    def _check_input(self, x: Tensor | None) -> Tensor:
        if x is None:
            raise ValueError(f"{type(self).__name__} is per-example: forward needs an input x")
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have shape (batch, {self.in_features}), got {tuple(x.shape)}")
        if self.check_finite and not torch.isfinite(x).all():
            raise ValueError("x contains NaN or inf (check_finite=True)")
        return x

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
        return per_gate.sum() / per_gate.shape[0]

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
