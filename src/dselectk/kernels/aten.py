"""DSelect-k's and the selector ablation's hand-written autograd nodes (ATen calls).

The math lives in :mod:`dselectk.functional` (plain, composable formulas); this module holds
the ``torch.autograd.Function`` kernels that compute the same numbers in one node with a written
out backward pass (tested against the composed formulas):

* :class:`_DSelectFused`: DSelect-k's q̃ and selector entropies, O(N) per selector, taken by
  :func:`dselectk.kernels.dselect_k_fused` for large problems;
* :class:`_DSelectSmall`: the same numbers for small problems (few calls), on CPU float32 and
  float64 computed on the host in NumPy (:mod:`dselectk.kernels.host_numpy`);
  :class:`_DSelectSmallGate` and :class:`_DSelectSmallGateLinear`: a small DSelect-k gate's
  whole step (logits or input in; weights and entropy loss out) in one node on the host;
  :class:`_OneThreadLinear` and :class:`_OneThreadSplitLinear`: a gate's linear layer on one
  intra-op thread; all used by :class:`dselectk.gates.DSelectK` (numba's nodes:
  :mod:`dselectk.kernels.numba_nodes`);
* :class:`_SelectorGate`: the softmax-selector ablation gate and its entropies.

Which node takes a problem is :func:`dselectk.kernels.dispatch.choose`'s. The DSelect-k kernels
run their ops on one thread below :data:`dselectk.runtime.PARALLEL_MIN_ELEMENTS` (see there why)
and bypass ``Function.apply``'s per-call argument binding (:func:`_apply`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from dselectk.kernels.host_numpy import (
    _entropy_grad,
    _entropy_loss,
    _host_gate,
    _host_gate_grad,
    _host_small,
    _host_small_grads,
    _HostSaved,
    _Transformed,
)
from dselectk.kernels.setting import _cpu_kernel
from dselectk.runtime import _OneThread, intra_op_threads

__all__: list[str] = []


# -- fused per-example / static DSelect-k kernel ---------------------------------------------
#
# q̃ = Σ_i σ(α)_i r(S(z⁽ⁱ⁾)) and the selector entropies Σ_j h(S(z_ij)) in one autograd node.
# The M bits of each selector are split into a low half (M_lo = floor(M/2) bits) and a high
# half (M_hi = M - M_lo bits). Each half is expanded by successive outer products into a joint
# law of L = 2**M_lo resp. H = 2**M_hi entries (O(sqrt N) per selector), and the K weighted
# selectors are combined into the (H, L) = N entries as a sum of K outer products: the only
# tensors with N entries per example are the output and its gradient (there is no (..., K, N)
# tensor). The first M_lo bits of both halves are expanded together; when M is odd the high
# half's last bit is one more outer product, with σ(α) folded into its two factors. Everything
# runs with the batch as the innermost (contiguous) dimension, so every small op is one
# vectorised pass over the batch (a batched matmul over B tiny (H, K) @ (K, L) products costs far
# more per example); only z, α, q̃ and their gradients are transposed. The combine and its
# backward are K resp. L + H fused multiply-adds into one buffer each; the backward of the
# expansion is, per bit level, one multiply-reduce and one multiply-add.


def _batch_last(t: Tensor) -> Tensor:
    """(B, *rest) -> contiguous (*rest, B) through one 2-D transpose (the fast copy kernel)."""
    b, rest = t.shape[0], t.shape[1:]
    return t.reshape(b, -1).t().contiguous().view(*rest, b)


def _batch_first(t: Tensor) -> Tensor:
    """(*rest, B) -> contiguous (B, *rest) through one 2-D transpose."""
    b, rest = t.shape[-1], t.shape[:-1]
    return t.reshape(-1, b).t().contiguous().view(b, *rest)


#: up to this many elements of the (K, H, L, B) outer products (K·N·B), the combine and its
#: backward are one broadcast product and a sum each (3 calls instead of K + L + H multiply-adds
#: and their indexing: 2.7x faster fwd+bwd at B = 256, K = 4, N = 128, 1 thread); above it the
#: multiply-add loops, which move less memory (2x faster at B = 4096)
_BROADCAST_MAX_ELEMENTS = 2**17


def _dselect_fused_forward(
    z: Tensor, alpha: Tensor, gamma: Tensor, m_lo: int
) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
    """Forward of :class:`_DSelectFused` on z (B, K, M), α (B, K): q̃ (B, N), entropies (B, K)."""
    s = (_batch_last(z) / gamma).clamp(-0.5, 0.5)  # (K, M, B): batch innermost
    p = s * (1.5 - 2.0 * s * s) + 0.5  # smooth_step, op for op
    q = 1.0 - p
    tiny = torch.finfo(p.dtype).tiny
    log_p, log_q = torch.log(p.clamp_min(tiny)), torch.log(q.clamp_min(tiny))
    ent = (p * log_p).addcmul_(q, log_q).sum(dim=1).neg_()  # (K, B) = selector_entropy(p)
    k, m, b = p.shape
    a = torch.softmax(_batch_last(alpha), dim=0)  # (K, B)
    # Bit j of the low half (bit j) and of the high half (bit M_lo + j), j < M_lo, side by side.
    bit_p = p[:, : 2 * m_lo].view(k, 2, m_lo, b)  # (K, half, M_lo, B)
    if m_lo:
        v = torch.stack((1.0 - bit_p, bit_p), dim=2)  # (K, half, value, M_lo, B)
        prefixes = [v[:, :, :, 0]]  # joint law of the first j + 1 bits: (K, 2, 2**j, B)
        for j in range(1, m_lo):
            prefixes.append((v[:, :, :, None, j] * prefixes[-1][:, :, None]).flatten(2, 3))
    else:  # M = 1: the low half is empty
        prefixes = [p.new_ones(k, 2, 1, b)]
    r_lo = prefixes[-1][:, 0]  # (K, L, B)
    if m % 2:  # the high half's last bit, weighted by σ(α): (K, 2, 1, B) ⊗ (K, 1, L, B)
        p_top = p[:, m - 1]
        top = torch.stack((1.0 - p_top, p_top), dim=1)  # (K, value, B)
        w = top * a.unsqueeze(1)
        hia = (w.unsqueeze(2) * prefixes[-1][:, 1, None]).flatten(1, 2)  # (K, H, B)
        saved = [s, bit_p, a, log_q - log_p, top, w, hia]
    else:
        top = prefixes[-1][:, 1]  # r_hi (K, H, B)
        hia = top * a.unsqueeze(1)
        saved = [s, bit_p, a, log_q - log_p, top, hia]
    if hia.numel() * r_lo.shape[1] <= _BROADCAST_MAX_ELEMENTS:  # (H, L, B): Σ_i hia_i ⊗ r_lo_i
        out = (hia.unsqueeze(2) * r_lo.unsqueeze(1)).sum(dim=0)
    else:
        out = hia[0, :, None] * r_lo[0, None]
        for i in range(1, k):
            out.addcmul_(hia[i, :, None], r_lo[i, None])
    return _batch_first(out).flatten(1), ent.t(), saved, prefixes


class _DSelectFused(torch.autograd.Function):
    """(z (B, K, M), α (B, K), γ) -> (q̃ (B, N), entropies (B, K), *saved); see the comment above.

    The intermediates the backward pass needs are returned as extra non-differentiable outputs
    (the ``setup_context`` form, which ``torch.func`` transforms require).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(z: Tensor, alpha: Tensor, gamma: Tensor) -> tuple[Tensor, ...]:
        with intra_op_threads(1, elements=z.shape[0] * z.shape[1] * 2 ** z.shape[2]):
            out, ent, saved, prefixes = _dselect_fused_forward(z, alpha, gamma, z.shape[-1] // 2)
        return (out, ent, *saved, *prefixes)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        z, _, gamma = inputs
        ctx.m_lo = z.shape[-1] // 2
        ctx.num_saved = 7 if z.shape[-1] % 2 else 6
        ctx.set_materialize_grads(False)  # no zero grads for the unused outputs
        ctx.mark_non_differentiable(*output[2:])
        ctx.save_for_backward(gamma, *output[2:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, g_out: Tensor | None, g_ent: Tensor | None, *_: Any
    ) -> tuple[Tensor, Tensor, None]:
        s = ctx.saved_tensors[1]
        with intra_op_threads(1, elements=s.shape[0] * s.shape[2] * 2 ** s.shape[1]):
            return _DSelectFused._backward(ctx, g_out, g_ent)

    @staticmethod
    def _backward(
        ctx: Any, g_out: Tensor | None, g_ent: Tensor | None
    ) -> tuple[Tensor, Tensor, None]:
        gamma, *tensors = ctx.saved_tensors
        saved, prefixes = tensors[: ctx.num_saved], tensors[ctx.num_saved :]
        s, bit_p, a, dent, top = saved[:5]
        hia = saved[-1]
        m_lo: int = ctx.m_lo
        k, m, b = s.shape
        odd = m % 2 == 1
        if g_out is not None:
            r_lo = prefixes[-1][:, 0]  # (K, L, B)
            n_hi, n_lo = hia.shape[1], r_lo.shape[1]
            g = _batch_last(g_out.view(b, n_hi, n_lo))  # (H, L, B)
            broadcast = hia.numel() * n_lo <= _BROADCAST_MAX_ELEMENTS
            if broadcast:  # one (K, H, L, B) product and a sum (few calls)
                g_hia = (r_lo.unsqueeze(1) * g).sum(dim=2)  # (K, H, B): grad of hia
            else:  # L multiply-adds into (K, H, B) (less memory traffic)
                g_hia = r_lo[:, 0, None] * g[None, :, 0]
                for i in range(1, n_lo):
                    g_hia.addcmul_(r_lo[:, i, None], g[None, :, i])
            if odd:  # hia = (w_0 P, w_1 P), P the high half's prefix, w = (1 - p_top, p_top) a
                w = saved[5]
                g_hia = g_hia.view(k, 2, n_lo, b)
                c = (g_hia * prefixes[-1][:, 1, None]).sum(dim=2)  # (K, value, B)
                g_a = (top * c).sum(dim=1)  # (K, B)
                g_top = a * (c[:, 1] - c[:, 0])  # d/dp_top
                g_hi = (g_hia[:, 0] * w[:, 0, None]).addcmul_(g_hia[:, 1], w[:, 1, None])
            else:  # hia = r_hi a
                g_a = (g_hia * top).sum(dim=1)
                g_hi = g_hia * a.unsqueeze(1)
            # grad of r_lo (K, L, B); nothing to reverse when the low half is empty (M = 1)
            if not m_lo:
                g_lo = torch.zeros_like(g_hi)
            elif broadcast:
                g_lo = (hia.unsqueeze(2) * g).sum(dim=1)
            else:
                g_lo = hia[:, 0, None] * g[None, 0]
                for i in range(1, n_hi):
                    g_lo.addcmul_(hia[:, i, None], g[None, i])
            g_joint = torch.stack((g_lo, g_hi), dim=1)  # (K, half, L, B)
            # Reverse the expansion prefix_j = v_j ⊗ prefix_{j-1}, v_j = (1 - p_j, p_j): with
            # d = g[value 1] - g[value 0], d/dp_j = Σ d·prefix_{j-1}, and the grad of the
            # previous level is (1 - p_j) g[value 0] + p_j g[value 1] = g[value 0] + p_j d.
            g_bits = []
            for j in range(m_lo - 1, 0, -1):
                gv = g_joint.unflatten(2, (2, -1))  # (K, 2, value, 2**j, B)
                d = gv[:, :, 1] - gv[:, :, 0]
                g_bits.append((d * prefixes[j - 1]).sum(dim=2))  # (K, 2, B)
                g_joint = torch.addcmul(gv[:, :, 0], d, bit_p[:, :, j : j + 1])
            if m_lo:  # level 0: the first factor pair itself
                g_bits.append(g_joint[:, :, 1] - g_joint[:, :, 0])
            g_bits.reverse()
            g_p = torch.stack(g_bits, dim=2).view(k, 2 * m_lo, b) if m_lo else None
            if odd:
                g_top = g_top.unsqueeze(1)
                g_p = g_top if g_p is None else torch.cat((g_p, g_top), dim=1)
            assert g_p is not None
        else:
            g_p = torch.zeros_like(s)  # (K, M, B)
            g_a = torch.zeros_like(a)  # (K, B)
        if g_ent is not None:
            g_p = torch.addcmul(g_p, _batch_last(g_ent).unsqueeze(1), dent)
        # dS/dz = (1.5 - 6 s²) / γ, exactly 0 at |s| = 1/2 (so the clamp needs no mask).
        g_z = _batch_first(g_p * (1.5 - 6.0 * s * s) / gamma)
        g_alpha = a * (g_a - (g_a * a).sum(dim=0))  # softmax backward, (K, B)
        return g_z, _batch_first(g_alpha), None


def _apply(cls: Any, args: tuple[Any, ...]) -> Any:
    """``cls.apply(*args)`` without ``Function.apply``'s per-call Python work.

    ``torch.autograd.Function.apply`` binds the arguments to ``forward``'s signature with
    ``inspect`` for every call of a ``setup_context`` Function (tens of µs, as much as the small
    kernel's arithmetic); the kernels here take positional arguments only, so outside torch.func
    transforms they go straight to the C++ ``apply`` (with dead functorch wrappers unwrapped, as
    ``Function.apply`` does).
    """
    if torch._C._are_functorch_transforms_active():
        with _Transformed():  # (no host kernel in its forward either: see _host_ok)
            return torch.autograd.Function.apply.__func__(cls, *args)  # type: ignore[attr-defined]
    unwrap = torch._C._functorch.unwrap_if_dead
    args = tuple(unwrap(a) if isinstance(a, Tensor) else a for a in args)
    return super(torch.autograd.Function, cls).apply(*args)


class _PositionalFunction(torch.autograd.Function):
    """A Function whose ``apply`` skips ``Function.apply``'s per-call signature binding
    (:func:`_apply`); subclasses take positional arguments only."""

    @classmethod
    def apply(cls, *args: Any) -> Any:
        return _apply(cls, args)


# -- small per-example / static DSelect-k kernel ---------------------------------------------
#
# The same q̃ and entropies for small problems (a few examples), where the cost is the number of
# ATen calls, not arithmetic: about 15 calls forward and 20 backward in one autograd node
# (the composed formulas take ~60 calls and as many autograd nodes, the fused kernel above ~90
# calls, most of them loops over bits and codes). Each selector's N codes are gathered from the
# (K, M, value) table of bit probabilities through a constant (N, M) index and multiplied
# (r = Π_j f_ij); the backward takes the product of the other M - 1 factors of each (i, j)
# through a second constant index (exact at zero factors, no division), and sums the factors'
# grads back onto the bits with one matmul against a constant one-hot (N·M, 2M) matrix. Work
# and memory are O(N·M²) per selector (the fused kernel: O(N)), hence small problems only.

_SMALL_TABLES: dict[tuple[int, torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor]] = {}


def _small_tables(
    m: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Constant tables of :class:`_DSelectSmall` for M bits, cached per (M, dtype, device).

    Returns:
        ``idx`` (N·M,): flat index of factor (i, j) = bit j of code i into the (M, 2) table
        (2j + bit); ``others`` (N·M·(M-1),): the indices of the other M - 1 factors of code i;
        ``onehot`` (N·M, 2M): row (i, j) has a 1 at ``idx[i, j]``.
    """
    key = (m, dtype, device)
    tables = _SMALL_TABLES.get(key)
    if tables is None:
        n = 2**m
        bits = (torch.arange(n).unsqueeze(-1) >> torch.arange(m)) & 1  # (N, M)
        idx = 2 * torch.arange(m) + bits  # (N, M)
        keep = ~torch.eye(m, dtype=torch.bool)  # (M, M): l != j
        others = idx.unsqueeze(1).expand(n, m, m)[:, keep].reshape(n, m, m - 1)
        onehot = torch.nn.functional.one_hot(idx.reshape(-1), 2 * m).to(dtype)
        tables = (idx.reshape(-1).to(device), others.reshape(-1).to(device), onehot.to(device))
        _SMALL_TABLES[key] = tables
    return tables


class _DSelectSmall(_PositionalFunction):
    """(z (G, K, M), α (G, K), γ (0-d or (G,))) -> (q̃ (G, N), entropies (G, K), *saved).

    Same numbers as :class:`_DSelectFused` (p = S(z) op for op, 1 - p as the composed
    formulas compute it); see the comment above for the method. The bits are laid out
    (M, value, G·K), selectors innermost, so that both gathers are ``index_select`` along the
    first dim (along the last dim it is 5-30x slower on the CPU, measured).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(z: Tensor, alpha: Tensor, gamma: Tensor) -> tuple[Any, ...]:
        if _host_ok(z, alpha) and gamma.device.type == "cpu" and _cpu_kernel() != "aten":
            return _host_small(z, alpha, gamma)  # see dselectk.kernels.host_numpy
        with intra_op_threads(1):  # small problems only: one thread (see dselectk.runtime)
            return _DSelectSmall._forward(z, alpha, gamma)

    @staticmethod
    def _forward(z: Tensor, alpha: Tensor, gamma: Tensor) -> tuple[Tensor, ...]:
        g, k, m = z.shape
        idx, _, _ = _small_tables(m, z.dtype, z.device)
        gam = gamma.reshape(-1, 1) if gamma.dim() else gamma  # against (M, G, K)
        s = (z.reshape(g * k, m).t().reshape(m, g, k) / gam).clamp_(-0.5, 0.5)  # (M, G, K)
        p = s * s
        p = p.mul_(-2.0).add_(1.5).mul_(s).add_(0.5)  # s (1.5 - 2 s²) + 0.5, op for op
        pq = torch.stack((1.0 - p, p), dim=1).reshape(2 * m, g * k)  # (M · value, G·K)
        log_pq = pq.clamp_min(torch.finfo(pq.dtype).tiny).log_()
        ent = (pq * log_pq).sum(dim=0).neg_().reshape(g, k)
        r = pq.index_select(0, idx).reshape(2**m, m, g * k).prod(dim=1)  # (N, G·K)
        a = torch.softmax(alpha, dim=-1)  # (G, K)
        r_t = r.reshape(-1, g, k).permute(1, 2, 0)  # (G, K, N), a view
        out = torch.bmm(a.unsqueeze(1), r_t).reshape(g, -1)  # (G, N)
        return out, ent, s, pq, log_pq, r, a

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        ctx.set_materialize_grads(False)
        if isinstance(output[2], _HostSaved):
            ctx.host = output[2]
            return
        ctx.host = None
        ctx.mark_non_differentiable(*output[2:])
        ctx.save_for_backward(inputs[2], *output[2:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, g_out: Tensor | None, g_ent: Tensor | None, *_: Any
    ) -> tuple[Tensor | None, Tensor | None, None]:
        host = ctx.host
        if host is not None:
            if g_out is None and g_ent is None:
                return None, None, None
            g_z, g_alpha = _host_small_grads(host, g_out, g_ent)
            return g_z, g_alpha, None
        with intra_op_threads(1):
            return _DSelectSmall._backward(ctx, g_out, g_ent)

    @staticmethod
    def _backward(
        ctx: Any, g_out: Tensor | None, g_ent: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, None]:
        gamma, s, pq, log_pq, r, a = ctx.saved_tensors
        if g_out is None and g_ent is None:
            return None, None, None
        m, g, k = s.shape
        n = 2**m
        g_alpha = None
        if g_out is not None:
            _, others, onehot = _small_tables(m, s.dtype, s.device)
            r_t = r.reshape(n, g, k).permute(1, 2, 0)  # (G, K, N)
            g_a = torch.bmm(r_t, g_out.unsqueeze(-1)).reshape(g, k)
            g_alpha = a * (g_a - (g_a * a).sum(dim=-1, keepdim=True))  # softmax backward
            g_r = g_out.t().unsqueeze(-1) * a  # (N, G, K)
            rest = pq.index_select(0, others).reshape(n, m, m - 1, g * k)
            g_f = rest.prod(dim=2).mul_(g_r.reshape(n, 1, g * k))  # (N, M, G·K): grad of f_ij
            g_pq = torch.mm(onehot.t(), g_f.reshape(n * m, g * k)).reshape(m, 2, g * k)
            g_p = g_pq[:, 1] - g_pq[:, 0]  # (M, G·K)
            if g_ent is not None:  # d h(p) / dp = log(1 - p) - log p (clamped logs)
                dent = log_pq.reshape(m, 2, g * k)
                g_p.addcmul_(g_ent.reshape(1, g * k), dent[:, 0] - dent[:, 1])
        else:
            assert g_ent is not None
            dent = log_pq.reshape(m, 2, g * k)
            g_p = g_ent.reshape(1, g * k) * (dent[:, 0] - dent[:, 1])
        # dS/dz = (1.5 - 6 s²) / γ, exactly 0 at |s| = 1/2 (so the clamp needs no mask).
        gam = gamma.reshape(-1, 1) if gamma.dim() else gamma
        d = s * s
        g_s = d.mul_(-6.0).add_(1.5).mul_(g_p.reshape(m, g, k)).div_(gam)  # (M, G, K)
        return g_s.reshape(m, g * k).t().reshape(g, k, m), g_alpha, None


_HOST_DTYPES = (torch.float32, torch.float64)


def _host_ok(*tensors: Tensor) -> bool:
    """Whether the small kernels may compute on the host (NumPy, :mod:`.host_numpy`): CPU
    float32/float64 tensors of one dtype, eager (no torch.func transform, no graph capture or
    compilation)."""
    t = tensors[0]
    for u in tensors:  # (a loop, not all() over a generator: ~0.5 µs a call less)
        if not (u.is_cpu and u.dtype == t.dtype):
            return False
    return t.dtype in _HOST_DTYPES and not (
        torch._C._are_functorch_transforms_active()
        or _Transformed.depth()  # (under torch.func.grad a node's forward runs untransformed)
        or torch.compiler.is_compiling()  # also torch.export and the dynamo ONNX export
        or torch.jit.is_tracing()  # also the TorchScript ONNX export
    )


class _DSelectSmallGate(_PositionalFunction):
    """A DSelect-k gate's whole step on the host: (logits (G, K(1+M)), γ (0-d or (G,)), λ, K,
    lead, per_example) -> (q̃ (*lead, N), auxiliary loss (), saved).

    The NumPy small kernel (see the comment above) on the gate's logits, and the entropy term
    of the auxiliary loss with the gate's ATen calls (``host_numpy._entropy_loss``): one
    node instead of the logits' two slices, the small kernel and four loss nodes. Bit for bit
    what the gate computes through :func:`dselectk.kernels.dselect_k_fused` (values and
    gradients). For CPU float32/float64 only (:func:`_host_ok`); the gate checks."""

    @staticmethod
    def forward(
        logits: Tensor,
        gamma: Tensor,
        lam: Tensor,
        k: int,
        lead: tuple[int, ...],
        per_example: bool,
    ) -> tuple[Any, ...]:
        out, ent, saved = _host_gate(logits, gamma, k)
        return out.view(*lead, -1), _entropy_loss(ent, lam, k, lead, per_example), saved

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        ctx.set_materialize_grads(False)
        ctx.host = output[2]
        ctx.k, ctx.lead, ctx.per_example = inputs[3], inputs[4], inputs[5]
        ctx.dtype = inputs[0].dtype
        ctx.save_for_backward(inputs[2])  # λ (an in-place change before backward raises)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_w: Tensor | None, g_aux: Tensor | None, *_: Any) -> tuple[Any, ...]:
        none = (None,) * 5
        if g_w is None and g_aux is None:
            return (None, *none)
        g_ent = None if g_aux is None else _entropy_grad(ctx, g_aux, ctx.saved_tensors[0])
        return (_host_gate_grad(ctx.host, g_w, g_ent, ctx.k), *none)


class _DSelectSmallGateLinear(_PositionalFunction):
    """:class:`_DSelectSmallGate` with the gate's linear layer in the node: (x (B, p), weight,
    bias or None, γ, λ, K, lead, per_example) -> (q̃ (*lead, N), auxiliary loss (), saved).

    The logits and the grads of x, weight and bias are :func:`_linear`'s and
    :func:`_linear_grads`' ATen calls, on one thread: the numbers of the layer and
    :class:`_DSelectSmallGate` in two nodes. Used by :class:`dselectk.gates.DSelectK` for a
    plain ``nn.Linear`` (no hooks, no autocast)."""

    @staticmethod
    def forward(
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        gamma: Tensor,
        lam: Tensor,
        k: int,
        lead: tuple[int, ...],
        per_example: bool,
    ) -> tuple[Any, ...]:
        with _OneThread():  # small problems: one thread (see dselectk.runtime._OneThread)
            logits = _linear(x, weight, bias)
            out, ent, saved = _host_gate(logits.view(math.prod(lead), -1), gamma, k)
            return out.view(*lead, -1), _entropy_loss(ent, lam, k, lead, per_example), saved

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        ctx.set_materialize_grads(False)
        ctx.host = output[2]
        ctx.k, ctx.lead, ctx.per_example = inputs[5], inputs[6], inputs[7]
        ctx.dtype = inputs[0].dtype
        ctx.save_for_backward(inputs[4], inputs[0], inputs[1])  # λ, x, weight

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_w: Tensor | None, g_aux: Tensor | None, *_: Any) -> tuple[Any, ...]:
        none = (None,) * 5
        if g_w is None and g_aux is None:
            return (None, None, None, *none)
        lam, x, weight = ctx.saved_tensors
        g_ent = None if g_aux is None else _entropy_grad(ctx, g_aux, lam)
        g = _host_gate_grad(ctx.host, g_w, g_ent, ctx.k).view(x.shape[0], -1)  # grad of logits
        with _OneThread():
            return (*_linear_grads(g, x, weight, ctx.needs_input_grad), *none)


_linear = torch.nn.functional.linear  # (bound once; on 2-D: ATen's addmm, mm without a bias)


def _linear_grads(g: Tensor, x: Tensor, weight: Tensor, needs: tuple[bool, ...]) -> tuple[Any, ...]:
    """The grads of x, weight and bias from the grad ``g`` of :func:`_linear`: the calls of
    autograd's backward of it (``g @ W``, ``g.t() @ x``, ``g.sum(0)``), None where not needed."""
    return (
        g.mm(weight) if needs[0] else None,
        g.t().mm(x) if needs[1] else None,
        g.sum(0) if needs[2] else None,
    )


class _OneThreadLinear(_PositionalFunction):
    """``F.linear`` on a 2-D input, (x (B, p), weight, bias or None) -> (B, out): the layer's
    ATen calls, forward and backward on one intra-op thread (``dselectk.runtime._OneThread``)."""

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        with _OneThread():
            return _linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.save_for_backward(inputs[0], inputs[1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        with _OneThread():
            return _linear_grads(g, x, weight, ctx.needs_input_grad)


class _OneThreadSplitLinear(_PositionalFunction):
    """A per-example gate's layer and the split of its logits: (x (B, p), weight, bias or None,
    lead, K, M) -> (α (*lead, K), Z (*lead, K, M)), copies of the slices of the logits, forward
    and backward on one intra-op thread (``dselectk.runtime._OneThread``). The backward writes
    the grads of α and Z into one grad of the logits (what the slices' backward nodes compute,
    without their zero-fills, copies and sum on two threads), then the layer's grads
    (:func:`_linear_grads`)."""

    @staticmethod
    def forward(
        x: Tensor, weight: Tensor, bias: Tensor | None, lead: tuple[int, ...], k: int, m: int
    ) -> tuple[Tensor, Tensor]:
        with _OneThread():
            logits = _linear(x, weight, bias).view(*lead, k * (1 + m))
            return logits[..., :k].clone(), logits[..., k:].unflatten(-1, (k, m)).clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.set_materialize_grads(False)
        ctx.lead, ctx.k, ctx.m = inputs[3], inputs[4], inputs[5]
        ctx.save_for_backward(inputs[0], inputs[1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_alpha: Tensor | None, g_z: Tensor | None) -> tuple[Any, ...]:
        none = (None, None, None)
        if g_alpha is None and g_z is None:
            return (None, None, None, *none)
        x, weight = ctx.saved_tensors
        k = ctx.k
        with _OneThread():
            g = x.new_empty(x.shape[0], weight.shape[0])
            parts = g.view(*ctx.lead, k * (1 + ctx.m))  # (not -1: the batch may be empty)
            if g_alpha is None:
                parts[..., :k].zero_()
            else:
                parts[..., :k].copy_(g_alpha)
            if g_z is None:
                parts[..., k:].zero_()
            else:
                parts[..., k:].copy_(g_z.flatten(-2))
            return (*_linear_grads(g, x, weight, ctx.needs_input_grad[:3]), *none)


# -- softmax-selector ablation gate -----------------------------------------------------------


def _softmax_small(x: Tensor) -> Tensor:
    """Softmax along a short last dim (K selectors): cheaper than ``torch.softmax`` there."""
    e = (x - x.amax(dim=-1, keepdim=True)).exp_()
    return e.div_(e.sum(dim=-1, keepdim=True))


#: at or below this temperature the selector node flushes probabilities below float32's
#: smallest normal number to exact zeros before exp (see ``_SelectorGate.forward``)
_FLUSH_TEMPERATURE = 0.05


class _SelectorGate(torch.autograd.Function):
    """(logits (..., K(1+n)), τ, K) -> (Σ_i σ(α)_i σ(β⁽ⁱ⁾/τ) (..., n), entropies (..., K), *saved).

    One autograd node for the gate and the selectors' entropies. The entropy is computed from
    the log-softmax ℓ = log σ(β/τ) (clamped at log(tiny), as :func:`dselectk.functional.entropy`
    clamps the probabilities, so -inf logits and τ -> 0 stay finite) as h = -Σ σ ℓ, and the
    backward pass is written out: with u = σ(α) g_w - g_h ℓ, the grad of β/τ is σ (u - Σ σ u)
    (the softmax backward, into which the entropy's grad -σ (ℓ + h) folds). Exactly one-hot
    selectors (τ -> 0) get an exactly zero grad, before the division by τ. The grad of the
    logits is one tensor (no zero-filled grads of the α and β slices).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(logits: Tensor, temperature: Tensor, k: int) -> tuple[Tensor, ...]:
        alpha = logits[..., :k]
        beta = logits[..., k:].unflatten(-1, (k, -1))
        a = _softmax_small(alpha)  # (..., K)
        log_s = torch.log_softmax(beta / temperature, dim=-1)  # (..., K, n)
        log_tiny = math.log(torch.finfo(log_s.dtype).tiny)
        if log_s.device.type == "cpu" and bool((temperature <= _FLUSH_TEMPERATURE).any()):
            # At small τ most log-probabilities lie far below exp's range, where the CPU's
            # vectorized exp takes a slow path (15x slower measured at τ = 1e-3 after
            # training): exponentiate 0 there instead and write the exact zeros afterwards.
            # Same s except that denormal probabilities (< 1.2e-38) become 0. Decided on τ,
            # not on the data, so the node has no data-dependent branch (torch.func works).
            under = log_s < log_tiny
            s = log_s.masked_fill(under, 0.0).exp_().masked_fill_(under, 0.0)
        else:
            s = log_s.exp()
        log_s = log_s.clamp_min_(log_tiny)
        weights = (a.unsqueeze(-1) * s).sum(dim=-2)
        ent = (s * log_s).sum(dim=-1).neg_()
        return weights, ent, a, s, log_s

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*output[2:])
        ctx.save_for_backward(inputs[1], *output[2:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, g_w: Tensor | None, g_ent: Tensor | None, *_: Any
    ) -> tuple[Tensor | None, None, None]:
        temperature, a, s, log_s = ctx.saved_tensors
        if g_w is None and g_ent is None:
            return None, None, None
        if g_w is not None:
            gw = g_w.unsqueeze(-2)
            u = a.unsqueeze(-1) * gw  # grad of s from the weights
            g_a = (s * gw).sum(dim=-1)
            if g_ent is not None:
                u.addcmul_(g_ent.unsqueeze(-1), log_s, value=-1.0)
        else:
            assert g_ent is not None
            u = (g_ent.unsqueeze(-1) * log_s).neg_()
            g_a = torch.zeros_like(a)
        g_beta = u.sub_((s * u).sum(dim=-1, keepdim=True)).mul_(s).div_(temperature)
        g_alpha = a * (g_a - (g_a * a).sum(dim=-1, keepdim=True))  # softmax backward
        return torch.cat((g_alpha, g_beta.flatten(-2)), dim=-1), None, None
