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

The gate answers for itself: callers ask it instead of switching on its class.
:meth:`Gate.is_binary` (is the selection final, per gate), :meth:`Gate.binary_entries` (for the
gates with ``binarizes``), :meth:`Gate.selection` / :meth:`Gate.set_selection` (the discrete
selection a swap search moves, for the gates with ``searchable``), :meth:`Gate.diagnostics`
(what telemetry logs), :meth:`Gate.inference_weights` (what evaluation uses) and
:meth:`Gate.freeze_blocker` (why :func:`dselectk.export.freeze` must wait).

``forward`` is pure: it returns the weights and the auxiliary loss (entropy terms, penalties,
balancing losses) in a :class:`GateOutput`; nothing is stored on the module and nothing calls
``backward``. Per-example auxiliary losses are averaged over the batch, so their weight does not
depend on the batch size; losses of the T gates of a bank are summed (one term per task, as
when each task's gate adds its own regulariser to a summed multi-task loss).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from dselectk._validate import check_input_like
from dselectk.gates.hyperparameter import (
    HyperParameter,
    check_nonnegative,
    check_positive_int,
    format_hyperparameter,
    hyperparameters,
)

__all__ = [
    "Gate",
    "GateOutput",
    "HyperParameter",
    "check_nonnegative",
    "check_positive_int",
    "format_hyperparameter",
    "hyperparameters",
]


@functools.cache
def _init_arguments(cls: type) -> frozenset[str]:
    """The names of the arguments of ``cls.__init__``."""
    return frozenset(inspect.signature(cls.__init__).parameters)


class GateOutput(NamedTuple):
    """What a gate's forward returns.

    Examples:
        >>> from dselectk.gates import SoftmaxGate
        >>> weights, aux_loss = SoftmaxGate(4, in_features=8)(torch.randn(4, 8))
        >>> tuple(weights.shape), float(aux_loss)
        ((4, 4), 0.0)
    """

    weights: Tensor
    """Expert weights, shape as in the table of :mod:`dselectk.gates.base`."""
    aux_loss: Tensor
    """Scalar to add to the training loss (already multiplied by its weights λ, ξ, ...)."""


_EXTRA_STATE = "_extra_state"  # torch's key of get_extra_state()


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

    Examples:
        Every gate is called the same way; its settings give the shape of the weights:

        >>> from dselectk.gates import SoftmaxGate, TopKGate
        >>> tuple(SoftmaxGate(4)().weights.shape)  # static: no input
        (4,)
        >>> gate = TopKGate(4, k=2, in_features=16, num_gates=3)  # per-example, 3 tasks
        >>> out = gate(torch.randn(4, 16))  # (batch, in_features)
        >>> tuple(out.weights.shape), out.aux_loss.dim()  # (batch, num_gates, experts), scalar
        ((4, 3, 4), 0)
        >>> (out.weights > 0).sum(-1).tolist()[0]  # k = 2 experts per example and task
        [2, 2, 2]
    """

    #: whether outputs are promised to lie on the probability simplex
    on_simplex: bool = True
    #: at most this many nonzeros per output (None: no promise); set by sparse gates
    max_nonzeros: int | None = None
    #: whether :meth:`selection` / :meth:`set_selection` work (static gates only): the swap
    #: search of :mod:`dselectk.search` can move this gate's selection
    searchable: bool = False
    #: whether the selection starts smooth and becomes final (binary) only as training
    #: converges (DSelect-k's S(Z), COMET's trees): :meth:`binary_entries` is then defined and
    #: :meth:`is_binary` measures it; False for gates whose selection is final by construction
    #: (Top-k, Gumbel-softmax in eval mode, a frozen gate) or never final (softmax, the
    #: softmax-selector ablations)
    binarizes: bool = False
    #: whether :meth:`inference_weights` applies a post-hoc rule to the gate's own weights (the
    #: softmax-selector ablations' argmax), so that the own, soft weights are a second model
    posthoc_inference: bool = False

    #: constructor keywords of earlier versions, each with what replaced it: passing one is a
    #: TypeError that says so (subclasses extend it)
    _removed_keywords: ClassVar[Mapping[str, str]] = {
        "check_finite": "it was a debug switch; check the input yourself "
        "(torch.isfinite(x).all()), and train() already stops on a non-finite loss or "
        "gradient (TrainConfig(nonfinite=...))",
    }

    def __new__(cls, *args: Any, **kwargs: Any) -> Gate:
        for key in kwargs:
            # (a subclass whose constructor names such an argument takes it as its own)
            if key in cls._removed_keywords and key not in _init_arguments(cls):
                raise TypeError(
                    f"{cls.__name__}() takes no argument {key!r}: {cls._removed_keywords[key]}"
                )
        return super().__new__(cls)

    def __setattr__(self, name: str, value: Any) -> None:
        # an option of earlier versions is refused, not stored as an attribute nothing reads
        if name in type(self)._removed_keywords:
            raise AttributeError(
                f"{type(self).__name__} has no attribute {name!r}: "
                f"{type(self)._removed_keywords[name]}"
            )
        super().__setattr__(name, value)

    def __init__(
        self,
        num_experts: int,
        *,
        in_features: int | None = None,
        num_gates: int | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts = check_positive_int("num_experts", num_experts, 2)
        self.in_features = (
            None if in_features is None else check_positive_int("in_features", in_features)
        )
        self.num_gates = None if num_gates is None else check_positive_int("num_gates", num_gates)
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

    # -- initialisation -------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise the gate as its constructor does, from its hyperparameters alone.

        The hyperparameter buffers get back the values last assigned (or loaded; see
        :meth:`HyperParameter.restore`), every child layer its own default initialisation (a
        per-example gate's linear layer, in registration order), then the gate its own
        (:meth:`_init_parameters`). With the same random state this gives, bit for bit, the
        tensors the constructor gives on the CPU. Nothing reads a tensor's value on the way, so
        a gate built on the meta device (``with torch.device("meta"): ...``) becomes a working
        gate after ``gate.to_empty(device=...)`` and ``gate.reset_parameters()``.
        """
        for hp in hyperparameters(self).values():
            hp.restore(self)
        for child in self.children():
            reset = getattr(child, "reset_parameters", None)
            if callable(reset):
                reset()
        self._init_parameters()

    def _init_parameters(self) -> None:
        """The gate's own initialisation, after the child layers' defaults (none by default).

        Called once by the constructor (after the layers were built) and by
        :meth:`reset_parameters`; it must not read a tensor's value (meta device) other than
        through the :class:`HyperParameter` descriptors.
        """

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
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
        if self.proj is not None:
            check_input_like(x, self.proj.weight)
        if x.dim() < 2 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"x must have shape (batch, {self.in_features}) or (..., {self.in_features}) "
                f"(tokens), got {tuple(x.shape)}"
            )
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
        # The state goes through the setters' checks before anything is copied: a
        # hyperparameter that is not finite or out of range, or the state of a gate of another
        # meaning (number of experts, k) with the same shapes, is refused and the gate is left
        # as it was. A state saved before these entries existed loads without the check.
        self._check_meaning(state_dict.get(prefix + _EXTRA_STATE), prefix)
        hps = hyperparameters(self).values()
        for hp in hps:
            new = state_dict.get(prefix + hp.buffer_name)
            if isinstance(new, Tensor) and not new.is_meta:
                hp.check_state(new, prefix)
        # A hyperparameter saved in the other form (one value vs one per gate) replaces the
        # buffer's shape, as assigning it would; other mismatches are left to torch's checks.
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
        if prefix + _EXTRA_STATE in missing_keys:  # saved before the gate kept its meaning
            missing_keys.remove(prefix + _EXTRA_STATE)

    def _meaning(self) -> tuple[int, int]:
        k = getattr(self, "k", None)
        return self.num_experts, 0 if k is None else int(k)

    def get_extra_state(self) -> Tensor:
        """The gate's meaning, saved in its ``state_dict``: ``[num_experts, k]`` (k = 0 for a
        gate without k). :meth:`load_state_dict` refuses the state of a gate of another meaning
        (a 5-expert DSelect-k has the shapes of a 6-expert one); a state saved without this
        entry loads without that check."""
        # float64 (exact for these integers): a state cast as a whole, e.g. ``.double()`` of
        # every value, still compares equal
        return torch.tensor(self._meaning(), dtype=torch.float64)

    def set_extra_state(self, state: Any) -> None:
        """Checked in :meth:`_load_from_state_dict` before anything loads; nothing to set."""

    def _check_meaning(self, saved: Any, prefix: str) -> None:
        if saved is None:
            return
        if not isinstance(saved, Tensor) or saved.is_meta or saved.numel() != 2:
            raise ValueError(
                f"{prefix}{_EXTRA_STATE}: expected a gate's [num_experts, k], got {saved!r}"
            )
        n, k = saved.detach().cpu().reshape(-1).tolist()
        if (n, k) != self._meaning():  # (a float equals its int)
            have, got = self._meaning(), (int(n), int(k)) if math.isfinite(n + k) else (n, k)
            raise ValueError(
                f"{prefix or 'state_dict'}: the state is that of a {type(self).__name__} with "
                f"num_experts={got[0]}"
                + (f", k={got[1]}" if got[1] else "")
                + f"; this gate has num_experts={have[0]}"
                + (f", k={have[1]}" if have[1] else "")
                + " (same shapes, another meaning)"
            )

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

    @torch.no_grad()
    def inference_weights(self, x: Tensor | None = None) -> Tensor:
        """The weights the gate uses at evaluation, without gradients.

        The default is :meth:`expert_weights` (call it in eval mode for gates whose training
        weights are random); gates that apply a post-hoc rule at evaluation override it (the
        softmax-selector ablations: each selector replaced by its argmax).

        Args:
            x: the input of a per-example gate, ``(B, p)`` or tokens ``(..., p)``; None for a
                static gate.

        Returns:
            Weights shaped as :meth:`forward`'s: ``(n,)``, ``(T, n)``, ``(B, [T,] n)``.
        """
        return self.expert_weights(x)

    # -- the gate's own answers: binarity, selection, diagnostics, freezing ------------------
    def _gate_lead(self) -> tuple[int, ...]:
        return () if self.num_gates is None else (self.num_gates,)

    def _param_device(self) -> torch.device:
        for t in (*self.parameters(), *self.buffers()):
            return t.device
        return torch.device("cpu")

    def _constant_binary(self, value: bool, x: Tensor | None) -> Tensor:
        """:meth:`is_binary` of a gate whose answer does not depend on its state."""
        device = self._param_device()
        if self.static:
            return torch.full(self._gate_lead(), value, dtype=torch.bool, device=device)
        self._check_input(x)
        return torch.full(self._gate_lead(), float(value), device=device)

    @torch.no_grad()
    def binary_entries(self, x: Tensor | None = None) -> Tensor:
        """Which of the smooth quantities the gate drives to 0/1 are exactly 0 or 1.

        Defined for the gates with :attr:`binarizes` (DSelect-k: the bits S(Z), K·M per gate;
        COMET: each tree's leaf probabilities, k·n per gate).

        Args:
            x: the input of a per-example gate (``(B, p)`` or tokens); None for a static gate.

        Returns:
            bool ``(*lead, E)``, E entries per gate; ``lead`` is (), (T,), (B,) or (B, T).

        Raises:
            NotImplementedError: the gate has no such quantities (``binarizes`` is False).
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no smooth selection that becomes binary "
            "(binarizes is False); see is_binary"
        )

    @torch.no_grad()
    def is_binary(self, x: Tensor | None = None) -> Tensor:
        """Whether the gate's selection is final, per gate of the bank.

        Gates with :attr:`binarizes` answer from :meth:`binary_entries` (every entry 0 or 1);
        gates whose selection is final by construction (Top-k, Gumbel-softmax's eval-mode hard
        mask, a frozen :class:`~dselectk.gates.fixed.FixedGate`) always answer True; the others
        (softmax, whose weights are dense, and the softmax-selector ablations, whose selectors
        are softmaxes that reach a one-hot vector only in the limit) always answer False.

        Args:
            x: the input of a per-example gate (``(B, p)`` or tokens ``(..., p)``); None for a
                static gate.

        Returns:
            Static: bool, shape () or (T,). Per-example: the fraction of the examples (tokens)
            of ``x`` whose selection is final, float, shape () or (T,).
        """
        if not self.binarizes:
            return self._constant_binary(False, x)
        binary = self.binary_entries(x).all(dim=-1)  # (*lead,)
        if self.static:
            return binary
        return binary.reshape(-1, *self._gate_lead()).float().mean(dim=0)

    def _require_searchable(self, what: str) -> None:
        if not self.searchable:
            raise NotImplementedError(
                f"{type(self).__name__} has no discrete selection to {what} (searchable is False)"
            )
        if not self.static:
            raise ValueError(
                f"{type(self).__name__} is per-example: its selection is a function of the "
                "input, not a parameter"
            )

    @torch.no_grad()
    def selection(self) -> Tensor:
        """The current discrete selection of a static searchable gate: one expert per selector.

        Returns:
            long ``(K,)`` or ``(T, K)``: the expert index of each selector. DSelect-k: the code
            of the rounded S(Z) row (bit m worth 2**m, as :func:`dselectk.functional.selector`;
            a code >= n is an unused code that selects no expert). Top-k: its k selected
            experts, by decreasing logit.

        Raises:
            NotImplementedError: the gate is not :attr:`searchable`.
            ValueError: the gate is per-example.
        """
        self._require_searchable("read")
        raise NotImplementedError(f"{type(self).__name__} must implement selection")

    @torch.no_grad()
    def selection_is_final(self) -> Tensor:
        """Whether each selector's entry of :meth:`selection` is final (not fractional).

        Returns:
            bool, shaped like :meth:`selection`: DSelect-k: whether the selector's S(Z) row is
            binary; Top-k: always True.

        Raises:
            NotImplementedError: the gate is not :attr:`searchable`.
            ValueError: the gate is per-example.
        """
        self._require_searchable("read")
        raise NotImplementedError(f"{type(self).__name__} must implement selection_is_final")

    @torch.no_grad()
    def set_selection(self, experts: Tensor, *, scale: float = 1.0) -> None:
        """Move the selection of a static searchable gate in place (what the swap search does).

        Args:
            experts: long ``(K,)`` or ``(T, K)``, shaped like :meth:`selection`: the new expert
                of each selector, or -1 to leave that selector as it is. DSelect-k: selector i's
                Z row is written to ``±scale·γ`` per bit towards the code (binary, saturated); α
                is not touched. Top-k: the logits are swapped so that the requested experts hold
                the requested slots (the values of the logits are kept); the selected experts
                must then be distinct.
            scale: DSelect-k's write magnitude in units of γ, >= 0.5 (0.5 is just binary);
                ignored by gates that have none.

        Raises:
            NotImplementedError: the gate is not :attr:`searchable`.
            ValueError: the gate is per-example, or ``experts`` has the wrong shape or values.
            TypeError: ``experts`` is not an integer tensor.
        """
        self._require_searchable("write")
        raise NotImplementedError(f"{type(self).__name__} must implement set_selection")

    def _check_experts(self, experts: Tensor, shape: tuple[int, ...]) -> Tensor:
        """Validate :meth:`set_selection`'s ``experts`` against ``shape``; (G, K) long."""
        if not isinstance(experts, Tensor):
            experts = torch.as_tensor(experts)
        if experts.is_floating_point() or experts.is_complex() or experts.dtype == torch.bool:
            raise TypeError(f"experts must be an integer tensor, got {experts.dtype}")
        if tuple(experts.shape) != shape:
            raise ValueError(f"experts must have shape {shape}, got {tuple(experts.shape)}")
        bad = (experts < -1) | (experts >= self.num_experts)
        if bool(bad.any()):
            raise ValueError(
                f"experts must hold expert indices in [0, {self.num_experts}) or -1 (keep), "
                f"got {int(experts[bad][0])}"
            )
        return experts.to(torch.long).reshape(-1, shape[-1])

    @torch.no_grad()
    def selector_weights(self) -> Tensor:
        """Each selector's weights over the experts, of a static searchable gate.

        Returns:
            ``(K, n)`` or ``(T, K, n)``: DSelect-k: r(S(z⁽ⁱ⁾)) restricted to the n experts;
            Top-k: one-hot rows of its k selected experts.
        """
        self._require_searchable("read")
        raise NotImplementedError(f"{type(self).__name__} must implement selector_weights")

    @torch.no_grad()
    def diagnostics(self, x: Tensor | None = None) -> dict[str, Tensor]:
        """Gate-specific numbers for telemetry (see :mod:`dselectk.telemetry`).

        Args:
            x: the input of a per-example gate, ``(B, p)`` or tokens ``(..., p)``; ignored by
                static gates. Per-example values are means over its examples (tokens).

        Returns:
            name → tensor with one row per gate, ``(G,)`` or ``(G, ...)``, G = ``num_gates``
            (1 for a single gate). The default has none.
        """
        return {}

    def freeze_blocker(self, weights: Tensor) -> str | None:
        """Why freezing this static gate to ``weights`` would not give a sparse model yet.

        The default: a gate with k selectors (or a ``max_nonzeros`` promise) is converged once
        at most k weights are nonzero; a dense gate never is. Gates whose eval-mode selection is
        hard (frozen, Gumbel-softmax) or whose convergence is binarity (DSelect-k) override it.

        Args:
            weights: the gate's eval-mode weights, ``(n,)`` or ``(T, n)``.

        Returns:
            A reason (a phrase, for an error message), or None when the gate may be frozen.
        """
        k = self.max_nonzeros or getattr(self, "k", None)
        if k is None:
            return "it is a dense gate (every expert gets a weight)"
        nnz = int((weights != 0).sum(-1).max())
        if nnz > k:
            return f"{nnz} experts have a nonzero weight, more than k={k}"
        return None

    def extra_repr(self) -> str:
        kind = "static" if self.static else f"in_features={self.in_features}"
        gates = "" if self.num_gates is None else f", num_gates={self.num_gates}"
        return f"num_experts={self.num_experts}, {kind}{gates}"
