"""DSelect-k gate, static (Section 3.1) and per-example (Section 3.2)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from dselectk import functional as DF
from dselectk.gates.base import (
    Gate,
    GateOutput,
    HyperParameter,
    check_nonnegative,
    format_hyperparameter,
)
from dselectk.gates.hyperparameter import GAMMA_MIN
from dselectk.kernels.aten import (
    _DSelectSmallGate,
    _DSelectSmallGateLinear,
    _host_ok,
    _OneThreadLinear,
    _OneThreadSplitLinear,
)
from dselectk.kernels.dispatch import _dselect_k_parts, choose
from dselectk.runtime import PARALLEL_MIN_ELEMENTS

__all__ = ["DSelectK"]

_STATIC_ONLY = "{name} is a parameter of static gates only (this gate is per-example); use bits(x)"


_MODULE = torch.nn.modules.module  # (its global hooks' dicts)


def _has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` would run hooks (its own or global module hooks)."""
    m, g = module, _MODULE
    return bool(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        or g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
        or g._global_backward_pre_hooks
    )  # fmt: skip


class DSelectK(Gate):
    """DSelect-k: k single expert selectors over a binary encoding smoothed by a smooth-step.

    Static (``in_features=None``): q̃(α, Z) = Σ_{i<=k} σ(α)_i r(S(z⁽ⁱ⁾)) with α ∈ R^k and
    Z ∈ R^{k×m}, m = ceil(log2 n): k + k·m parameters per gate (Section 3.1.3).
    Per-example: v(G, W, x) = Σ_i σ(Gx + b_G)_i r(S(W⁽ⁱ⁾x + b_W)) (Section 3.2); G and all W⁽ⁱ⁾
    are one fused linear layer.

    The auxiliary loss is λ Σ_i h(r(S(z⁽ⁱ⁾))) (entropy regulariser, Section 3.1.3), computed as
    the sum of the bits' binary entropies, plus ξ Σ_i 1/Σ_{j<=n} r(S(z⁽ⁱ⁾))_j when n is not a
    power of two (Appendix B.2). Per-example, all terms are per example and averaged over the
    batch.

    Differences from the paper: optional biases in the per-example gate (on by default) and the
    optional ``distinct`` codes below (off by default). Two research options that measured no
    gain, a "spread" initialisation and a selector-diversity penalty, are in
    :class:`~dselectk.gates.ablation.DSelectKExtended`.

    Per-gate hyperparameters: in a bank (``num_gates=T``) ``gamma`` and ``entropy_reg`` may each
    be one number (all gates) or T numbers (a sequence or a (T,) tensor, gate t gets value t),
    in the constructor or by assignment; see
    :class:`~dselectk.gates.base.HyperParameter` (reading a per-gate value returns a (T,)
    tensor, a copy). A bank with per-gate values computes, gate for gate, what T single gates
    with those values compute; per-example banks (B, T, ...) broadcast them over the gate axis.

    Args:
        num_experts: n >= 2 (any n; Appendix B.2 handles non powers of two).
        k: number of selectors, 1 <= k <= n (at most k experts once S(Z) is binary).
        in_features: None (static) or input size p (per-example).
        gamma: smooth-step width γ > 0, or one per gate. Settable; a schedule may anneal it
            towards 0.
        entropy_reg: λ >= 0, or one per gate. Settable; a schedule may change it.
        xi: ξ >= 0, weight of the unused-code penalty (only when n is not a power of two).
        distinct: (ours) give the K selectors distinct expert codes by construction: before the
            smooth-step, a selector whose code (sign pattern of its z) an earlier selector holds,
            or that is no expert, has its least confident bits negated to reach the nearest free
            expert (:func:`~dselectk.functional.distinct_codes`). Once S(Z) is binary the gate
            selects exactly k distinct experts (per example: for every input). Default False
            (the paper's gate).
        num_gates, bias: see :class:`~dselectk.gates.base.Gate`.

    Examples:
        >>> from dselectk import DSelectK
        >>> gate = DSelectK(num_experts=8, k=2)  # static: one weight vector, no input
        >>> w = gate.expert_weights()  # (the weights, without gradients)
        >>> tuple(w.shape), round(float(w.sum()), 4)
        ((8,), 1.0)
        >>> gate.set_selection(torch.tensor([3, 5]))  # what a swap search does: binary S(Z)
        >>> gate().weights.nonzero().flatten().tolist(), bool(gate.is_binary())
        ([3, 5], True)
        >>> gate = DSelectK(8, k=2, in_features=16, num_gates=3)  # per-example, 3 tasks
        >>> tuple(gate(torch.randn(4, 16)).weights.shape)  # (batch, num_gates, experts)
        (4, 3, 8)
    """

    searchable = True
    binarizes = True
    _gamma: Tensor
    gamma = HyperParameter(positive=True, minimum=GAMMA_MIN)
    _entropy_reg: Tensor
    entropy_reg = HyperParameter(positive=False)
    _removed_keywords: ClassVar[Mapping[str, str]] = {
        **Gate._removed_keywords,
        "diversity": "the selector-diversity penalty is an option of "
        "dselectk.gates.DSelectKExtended (registered as 'dselect_k_extended')",
        "init": "DSelectK always starts as the paper does; the 'spread' init is an option of "
        "dselectk.gates.DSelectKExtended (registered as 'dselect_k_extended')",
    }

    def __init__(
        self,
        num_experts: int,
        k: int,
        *,
        in_features: int | None = None,
        gamma: float | Sequence[float] | Tensor = 1.0,
        entropy_reg: float | Sequence[float] | Tensor = 0.0,
        xi: float = 1.0,
        distinct: bool = False,
        num_gates: int | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_experts,
            in_features=in_features,
            num_gates=num_gates,
            bias=bias,
        )
        self._set_k(k)
        self.max_nonzeros = self.k  # once S(Z) is binary
        self.num_bits = DF.num_bits(num_experts)
        self.xi = check_nonnegative("xi", xi)
        # Schedulable values live in buffers (see HyperParameter).
        self.gamma = gamma
        self.entropy_reg = entropy_reg
        if not isinstance(distinct, bool):
            raise TypeError(f"distinct must be a bool, got {distinct!r}")
        self.distinct = distinct
        self._build_logits()
        self._init_parameters()

    def _logit_shape(self) -> tuple[int, ...]:
        return (self.k * (1 + self.num_bits),)

    # -- parameters -----------------------------------------------------------------------
    @torch.no_grad()
    def _init_parameters(self) -> None:
        """Initialise as in the reference: every S(Z_ij) strictly inside (0, 1) (Section 3.1.3).

        With one γ per gate, gate t's rows are drawn from U(-γ_t/100, γ_t/100), row after row
        (on the CPU the same random numbers as one draw over the whole tensor). Per-example, the
        layer's own default draws come first (:meth:`Gate.reset_parameters`) and are then
        overwritten, as in the constructor.
        """
        gamma = self.gamma
        if isinstance(gamma, Tensor):
            self._reset_per_gate([g / 100.0 for g in gamma.tolist()])
            return
        bound = gamma / 100.0
        k, m = self.k, self.num_bits
        if self.static:
            self.logits.uniform_(-bound, bound)
            offset = self._init_offset(self.logits.shape[:-1])
            if offset is not None:
                self.logits[..., k:] += offset.flatten(-2)
            return
        assert self.proj is not None
        g = 1 if self.num_gates is None else self.num_gates
        w = self.proj.weight.view(g, k * (1 + m), -1)
        nn.init.uniform_(w, -bound, bound)
        if self.proj.bias is not None:
            b = self.proj.bias.view(g, k * (1 + m))
            nn.init.uniform_(b, -bound, bound)
            offset = self._init_offset((g,))
            if offset is not None:
                b[:, k:] += offset.flatten(-2)

    def _reset_per_gate(self, bounds: list[float]) -> None:
        """:meth:`_init_parameters` with a bound per gate (the same draws, in the same order)."""
        k, m = self.k, self.num_bits
        if self.static:
            for row, b in zip(self.logits, bounds):
                row.uniform_(-b, b)
            offset = self._init_offset(self.logits.shape[:-1])
            if offset is not None:
                self.logits[..., k:] += offset.flatten(-2)
            return
        assert self.proj is not None and self.num_gates is not None
        g = self.num_gates
        w = self.proj.weight.view(g, k * (1 + m), -1)
        for row, b in zip(w, bounds):
            row.uniform_(-b, b)
        if self.proj.bias is not None:
            bias = self.proj.bias.view(g, k * (1 + m))
            for row, b in zip(bias, bounds):
                row.uniform_(-b, b)
            offset = self._init_offset((g,))
            if offset is not None:
                bias[:, k:] += offset.flatten(-2)

    def _init_offset(self, lead: tuple[int, ...]) -> Tensor | None:
        """(*lead, K, M) offsets a subclass adds to the initial Z (static) or the Z part of the
        layer's bias (per-example), or None: the paper's initialisation (here)."""
        return None

    def _penalty_on(self) -> bool:
        """Whether a subclass adds an auxiliary loss on Z (:meth:`_penalty`): a Python flag
        (no device sync, no graph break). False here."""
        return False

    def _penalty(self, z: Tensor) -> Tensor:
        """A subclass's auxiliary loss on Z (*lead, K, M), summed over the gates and averaged
        over the batch like the others; called only when :meth:`_penalty_on`."""
        raise NotImplementedError

    def split_logits(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Split flat logits (..., K(1+M)) into α (..., K) and Z (..., K, M)."""
        alpha = logits[..., : self.k]
        z = logits[..., self.k :].unflatten(-1, (self.k, self.num_bits))
        return alpha, z

    @property
    def alpha(self) -> Tensor:
        """Static gate: the selector logits α, (K,) or (T, K) (a view of the parameter)."""
        self._require_static("alpha")
        return self.split_logits(self.logits)[0]

    @property
    def z(self) -> Tensor:
        """Static gate: the encoding variables Z, (K, M) or (T, K, M) (a view of the parameter)."""
        self._require_static("z")
        return self.split_logits(self.logits)[1]

    def _require_static(self, name: str) -> None:
        if not self.static:
            raise AttributeError(_STATIC_ONLY.format(name=name))

    def __getattr__(self, name: str) -> Any:
        # A property that raises AttributeError makes Python fall back to __getattr__, and
        # nn.Module's would replace the message by a bare "object has no attribute". Still an
        # AttributeError (hasattr and torch.jit.trace rely on that), but one that says why.
        if name in ("alpha", "z") and self.__dict__.get("in_features") is not None:
            raise AttributeError(_STATIC_ONLY.format(name=name))
        try:
            return super().__getattr__(name)
        except AttributeError:
            removed = type(self)._removed_keywords.get(name)  # diversity, init: say where
            if removed is None:
                raise
            raise AttributeError(
                f"{type(self).__name__} has no attribute {name!r}: {removed}"
            ) from None

    # -- math -----------------------------------------------------------------------------
    def _codes_z(self, z: Tensor) -> Tensor:
        """Z as the gate uses it: with ``distinct``, each selector moved off the codes of the
        earlier ones (:func:`~dselectk.functional.distinct_codes`)."""
        return DF.distinct_codes(z, self.num_experts) if self.distinct else z

    def gate(self, logits: Tensor) -> GateOutput:
        out = self._gate_on_host(logits)
        if out is not None:
            return out
        return self._gate_parts(*self.split_logits(logits))

    def _gate_parts(self, alpha: Tensor, z: Tensor) -> GateOutput:
        """:meth:`gate` on the logits' parts α (*lead, K) and Z (*lead, K, M), as written."""
        z = self._codes_z(z)
        # One fused autograd node: smooth-step, the K selectors by successive outer products
        # (no (*lead, K, N) tensor), the σ(α) mixture and the bit entropies.
        # A per-gate γ (T,) broadcasts over the trailing gate axis of the (*lead,) gates.
        # γ was validated when written: no device sync here (see kernels.dispatch)
        w, ent = _dselect_k_parts(alpha, z, self._gamma)  # (*lead, N), (*lead, K)
        weights = w[..., : self.num_experts]
        per_gate = self._entropy_reg * ent.sum(dim=-1)  # a per-gate λ (T,) broadcasts likewise
        if self.num_experts < 2**self.num_bits and self.xi > 0:
            p = DF._smooth(z, self._per_gate(self._gamma, 2))  # (*lead, K, M)
            per_gate = per_gate + DF.unused_code_penalty(p, self.num_experts, self.xi).sum(-1)
        aux = self._reduce_aux(per_gate)
        if self._penalty_on():
            aux = aux + self._penalty(z)
        return GateOutput(weights, aux)

    def forward(self, x: Tensor | None = None) -> GateOutput:
        out = self._forward_on_host(x)
        return super().forward(x) if out is None else out

    def compute_logits(self, x: Tensor | None = None) -> Tensor:
        """The logits as :meth:`Gate.compute_logits` computes them; per-example problems below
        :data:`~dselectk.runtime.PARALLEL_MIN_ELEMENTS` selector entries (eager, CPU
        float32/float64, a plain ``nn.Linear``) run the layer on one intra-op thread
        (``_OneThreadLinear``, the layer's ATen calls): beside busy processes a 2-thread product
        of this size stalls for tens of ms (see ``dselectk.runtime._OneThread``)."""
        plain = self._plain_layer(x)
        if plain is None or plain[3] >= PARALLEL_MIN_ELEMENTS:
            return super().compute_logits(x)
        assert isinstance(x, Tensor)
        logits = _OneThreadLinear.apply(x, plain[0], plain[1])
        return logits.view(*plain[2], *self._logit_shape())

    def _plain_layer(
        self, x: Tensor | None
    ) -> tuple[Tensor, Tensor | None, tuple[int, ...], int] | None:
        """(weight, bias, lead, selector entries) of a per-example gate whose layer is a plain
        ``nn.Linear`` (no hooks, no autocast, this class's
        :meth:`compute_logits`) on a (B, p) CPU float32/float64 input in eager mode; None
        otherwise."""
        proj = self._modules.get("proj")
        if (
            type(proj) is not nn.Linear
            or not isinstance(x, Tensor)
            or x.dim() != 2
            or x.shape[1] != self.in_features
            or type(self).compute_logits is not DSelectK.compute_logits
            or _has_hooks(proj)
            or torch.is_autocast_enabled("cpu")
            or not _host_ok(x)
        ):
            return None
        weight, bias = proj.weight, proj.bias
        if not (
            weight.dtype == x.dtype
            and weight.is_cpu
            and (bias is None or (bias.dtype == x.dtype and bias.is_cpu))
        ):
            return None
        lead = (x.shape[0],) if self.num_gates is None else (x.shape[0], self.num_gates)
        return weight, bias, lead, math.prod(lead) * self.k * 2**self.num_bits

    def _forward_on_host(self, x: Tensor | None) -> GateOutput | None:
        """:meth:`forward` with the linear layer inside the host node
        (``_DSelectSmallGateLinear``, the layer on one thread as in :meth:`compute_logits`) for
        a per-example gate of this class (see :meth:`_plain_layer`) and a problem the host node
        takes (:func:`dselectk.kernels.dispatch.choose`: by ``DSELECTK_KERNEL``, numba's at
        every size, NumPy's up to :data:`~dselectk.kernels.dispatch.HOST_GATE_MAX_ELEMENTS`
        selector entries, ATen's none); other problems below
        :data:`~dselectk.runtime.PARALLEL_MIN_ELEMENTS` take the layer and the split of the
        logits on one thread (``_OneThreadSplitLinear``), then the gate's math as written; None
        otherwise."""
        plain = self._plain_layer(x)
        if (
            plain is None
            or type(self).gate is not DSelectK.gate  # a subclass's own math goes its own way
            or not self._own_layout()
        ):
            return None
        weight, bias, lead, entries = plain
        k, m, n = self.k, self.num_bits, self.num_experts
        buffers = self._buffers
        gamma, lam = buffers["_gamma"], buffers["_entropy_reg"]
        assert gamma is not None and lam is not None and isinstance(x, Tensor)
        node = choose(entries, x, gamma, lam, host_math=self._host_math(), linear=True)
        if node is _DSelectSmallGateLinear:  # NumPy's (numba's: one γ per gate as it is)
            if gamma.dim() > 0:  # one γ per gate: flattened like the gates
                gamma = gamma.expand(lead).reshape(-1)
            w, aux, _ = node.apply(x, weight, bias, gamma, lam, k, lead, True)
        elif node is not None:  # numba's, every size
            w, aux = node.apply(x, weight, bias, gamma, lam, k, lead, True)
        elif entries < PARALLEL_MIN_ELEMENTS:
            # The layer and the split into α and Z on one thread (the slices' backward would
            # zero-fill, copy and add the logits' grad on two), then the gate's math as written.
            alpha, z = _OneThreadSplitLinear.apply(x, weight, bias, lead, k, m)
            return self._gate_parts(alpha, z)
        else:
            return None
        if n < 2**m:
            w = w[..., :n]
        if self._penalty_on():
            aux = aux + self._penalty(self.split_logits(self.compute_logits(x))[1])
        return GateOutput(w, aux)

    def _host_math(self) -> bool:
        """Whether the host nodes compute this gate's math: not so with ``distinct`` codes or
        the unused-code penalty (n < 2**M with ξ > 0)."""
        unused = self.num_experts < 2**self.num_bits and self.xi > 0
        return not (self.distinct or unused)

    def _own_layout(self) -> bool:
        """Whether the logits are laid out as DSelectK lays them out (the host nodes split them
        themselves): not so for a subclass with its own :meth:`split_logits`."""
        return type(self).split_logits is DSelectK.split_logits

    def _gate_on_host(self, logits: Tensor) -> GateOutput | None:
        """:meth:`gate` in one autograd node on the host (``_DSelectSmallGate``) for CPU
        problems the CPU kernel takes (see :meth:`_forward_on_host`): with NumPy's, bit for bit
        the numbers of :meth:`gate` as written; with numba's, the same to float rounding (the
        loss summed in float64). None where it does not apply (then :meth:`gate` computes as
        written)."""
        k, m, n = self.k, self.num_bits, self.num_experts
        # eager CPU float32/float64 first: under graph capture nothing below is traced
        if not self._host_math() or not self._own_layout() or not _host_ok(logits):
            return None
        lead = logits.shape[:-1]
        buffers = self._buffers  # (not through nn.Module.__getattr__: this is the hot path)
        gamma, lam = buffers["_gamma"], buffers["_entropy_reg"]
        assert gamma is not None and lam is not None
        node = choose(math.prod(lead) * k * 2**m, logits, gamma, lam)
        if node is None:
            return None
        flat = logits.reshape(-1, logits.shape[-1])
        if node is _DSelectSmallGate:  # NumPy's (numba's: one γ per gate as it is)
            if gamma.dim() > 0:  # one γ per gate: flattened like the gates
                gamma = gamma.expand(lead).reshape(-1)
            w, aux, _ = node.apply(flat, gamma, lam, k, lead, not self.static)
        else:  # numba's, every size
            w, aux = node.apply(flat, gamma, lam, k, lead, not self.static)
        if n < 2**m:
            w = w[..., :n]
        if self._penalty_on():
            aux = aux + self._penalty(self.split_logits(logits)[1])
        return GateOutput(w, aux)

    # -- introspection --------------------------------------------------------------------
    @torch.no_grad()
    def bits(self, x: Tensor | None = None) -> Tensor:
        """S(Z) (static, (K, M) or (T, K, M)) or S(Wx) per example ((B, [T,] K, M))."""
        _, z = self.split_logits(self.compute_logits(x))
        return DF.smooth_step(self._codes_z(z), self._per_gate(self._gamma, 2))

    @torch.no_grad()
    def binary_fraction(self, x: Tensor | None = None) -> float:
        """Fraction of the entries of S(Z) (or of S(Wx) over the batch) that are exactly 0 or 1."""
        p = self.bits(x)
        return float(((p == 0) | (p == 1)).float().mean())

    @torch.no_grad()
    def binary_entries(self, x: Tensor | None = None) -> Tensor:
        """Which bits of S(Z) (per-example: S(Wx)) are exactly 0 or 1: bool (*lead, K·M)."""
        p = self.bits(x)
        return ((p == 0) | (p == 1)).flatten(-2)

    # is_binary (Gate's, from binary_entries): static, whether S(Z) is binary per gate (bool,
    # () or (T,)); per-example, the fraction of the examples of x whose S(Wx) is (float).

    @torch.no_grad()
    def selection(self) -> Tensor:
        """The code of each selector's rounded S(Z) row (bit m worth 2**m), (K,) or (T, K)."""
        self._require_searchable("read")
        p = self.bits()
        place = torch.arange(self.num_bits, device=p.device)
        return (p.round().long() << place).sum(-1)

    @torch.no_grad()
    def selection_is_final(self) -> Tensor:
        """Whether each selector's S(Z) row is binary, bool (K,) or (T, K)."""
        self._require_searchable("read")
        p = self.bits()
        return ((p == 0) | (p == 1)).all(-1)

    @torch.no_grad()
    def set_selection(self, experts: Tensor, *, scale: float = 1.0) -> None:
        """Write selector i's Z row to ±``scale``·γ per bit towards the code ``experts[..., i]``.

        Args:
            experts: long (K,) or (T, K): the new expert of each selector, -1 to keep it.
            scale: >= 0.5 (binary); 1.0 (the swap search's default) saturates past γ/2.
        """
        self._require_searchable("write")
        if not float(scale) >= 0.5:
            raise ValueError(f"scale must be >= 0.5 (a move must be binary), got {scale}")
        k, m = self.k, self.num_bits
        e = self._check_experts(experts, (*self._gate_lead(), k))  # (G, K)
        z = self.logits.view(-1, self.logits.shape[-1])[:, k:].view(-1, k, m)  # (G, K, M) view
        gamma = self._gamma.reshape(-1, 1, 1).to(z)  # (1 or G, 1, 1)
        place = torch.arange(m, device=z.device)
        signs = ((e.to(z.device).clamp(min=0).unsqueeze(-1) >> place) & 1).float() * 2 - 1
        moved = signs * (scale * gamma)  # (G, K, M)
        z.copy_(torch.where((e >= 0).to(z.device).unsqueeze(-1), moved, z))

    @torch.no_grad()
    def selector_weights(self) -> Tensor:
        """r(S(z⁽ⁱ⁾)) of each selector over the n experts, (K, n) or (T, K, n)."""
        self._require_searchable("read")
        return DF.selector(self.bits())[..., : self.num_experts]

    @torch.no_grad()
    def diagnostics(self, x: Tensor | None = None) -> dict[str, Tensor]:
        """``binary_fraction``, ``binary``, ``selector_entropy``, ``collisions``, each (G,).

        ``binary_fraction``: the fraction of the entries of S(Z) (per-example: S(Wx)) that are
        exactly 0 or 1; ``binary``: whether all of them are (1/0; per-example: the fraction of
        the examples); ``selector_entropy``: Σ_m h(S(z_m)) per selector (nats), mean over the
        selectors; ``collisions``: pairs i < j of selectors whose codes (S(z) > 1/2 bitwise)
        pick the same expert (codes >= n select none). Per-example values are means over ``x``.
        """
        t_count, n = self.num_gates or 1, self.num_experts
        p = self.bits(None if self.static else x).float()
        p = p.reshape(-1, t_count, *p.shape[-2:])  # (N, T, K, M)
        binary = (p == 0) | (p == 1)
        both = torch.stack((p, 1 - p))
        bit_ent = -torch.special.xlogy(both, both).sum(0).sum(-1)  # (N, T, K)
        place = 2 ** torch.arange(p.shape[-1], device=p.device)
        codes = ((p > 0.5).long() * place).sum(-1)  # bit m is worth 2**m (functional.selector)
        return {
            "binary_fraction": binary.float().mean((0, 2, 3)),
            "binary": binary.flatten(2).all(-1).float().mean(0),
            "selector_entropy": bit_ent.mean((0, 2)),
            "collisions": DF.code_collisions(codes, n),
        }

    def freeze_blocker(self, weights: Tensor) -> str | None:
        """None once S(Z) is binary (at most k experts), else how much of it is."""
        if bool(self.is_binary().all()):
            return None
        return f"S(Z) is not binary yet ({self.binary_fraction():.1%} of its bits are)"

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, k={self.k}, gamma={format_hyperparameter(self.gamma)}, "
            f"entropy_reg={format_hyperparameter(self.entropy_reg)}"
            + (", distinct=True" if self.distinct else "")
        )

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
        # A state saved when DSelectK had the diversity option carries its buffer ``_diversity``:
        # at 0 (the default: the term was not computed) it loads and is dropped; a nonzero μ
        # belongs to DSelectKExtended, and loading it here would silently change the loss.
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        key = prefix + "_diversity"
        if key not in state_dict or "_diversity" in self._buffers:
            return
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        mu = state_dict[key]
        if isinstance(mu, Tensor) and not mu.is_meta and bool((mu != 0).any()):
            shown = format_hyperparameter(float(mu) if mu.dim() == 0 else mu)
            error_msgs.append(
                f"{key}: the state has a selector-diversity weight μ = {shown}, an option "
                "DSelectK no longer has; load it into dselectk.gates.DSelectKExtended (or set "
                "the entry to 0 to drop it)"
            )
