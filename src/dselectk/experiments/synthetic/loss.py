"""The fused training loss of the vectorized synthetic model (CPU fast path; its composed
autograd reference is ``benchmarks/synthetic_reference.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from dselectk.experiments.synthetic.model import SyntheticMoE

__all__ = ["LOSS_BLOCK_WEIGHTS", "mixture_loss"]

#: size of a block of :class:`_MixtureSSE`, in gate weights (repetitions × T × E): 10
#: repetitions at T = 128 (E = 32), all 100 at T <= 32. A block's (R, B, T) residual and
#: (B, U, R·E) activations are then about 1.3 MB each and stay in the CPU caches.
LOSS_BLOCK_WEIGHTS = 40_960


def _block_sse(
    x: Tensor, w: Tensor, b: Tensor, gw: Tensor, y: Tensor, grads: tuple[Tensor, ...] | None
) -> Tensor:
    """Σ (pred - y)² / B of one block of repetitions; writes its gradients into ``grads``."""
    re, p, u = w.shape
    reps, _, e = gw.shape
    n = x.shape[0]
    w_flat = w.permute(1, 2, 0).reshape(p, u * re)  # column u·RE + j: unit u of expert j
    h = torch.addmm(b.t().reshape(-1), x, w_flat).relu_().view(n, u, re)
    f = h.sum(dim=1).view(n, reps, e).transpose(0, 1)  # (R, B, E): expert outputs
    resid = torch.bmm(f, gw.transpose(1, 2)).sub_(y)  # (R, B, T)
    flat = resid.view(-1)
    loss = torch.dot(flat, flat) / n
    if grads is not None:
        d_w, d_b, d_gw = grads
        d_pred = resid.mul_(2.0 / n)
        torch.bmm(d_pred.transpose(1, 2), f, out=d_gw)
        d_f = torch.bmm(d_pred, gw).transpose(0, 1).reshape(n, 1, re)
        d_h = torch.ops.aten.threshold_backward(d_f.expand(n, u, re), h, 0.0).view(n, u * re)
        d_w.copy_((x.t() @ d_h).view(p, u, re).permute(2, 0, 1))
        d_b.copy_(d_h.sum(dim=0).view(u, re).t())
    return loss


class _MixtureSSE(torch.autograd.Function):
    """Σ_r Σ_t MSE_t,r of R batched one-layer MoEs, from the inputs to the loss in one node.

    Same value and gradients as ``SyntheticMoE.forward`` followed by
    ``(pred - y).square().mean(-1).sum()`` (tested against it, float64 gradcheck too), laid out
    for the CPU:

    * all R·E experts of a block are **one** (B, 10) @ (10, U·R·E) matmul (the input is shared,
      so no batched matmul of 10-wide matrices), and the unit sum runs over a leading axis;
    * the squared error is one subtraction and one dot product, and the backward pass is
      written out (one multiply for d loss / d pred, ``threshold_backward`` for the ReLU, two
      matmuls for the expert weights);
    * because the output is a scalar, the gradients are computed **in the forward pass**, block
      by block of repetitions (:data:`LOSS_BLOCK_WEIGHTS`), while each block's activations are
      still in cache; ``backward`` only scales them by the incoming gradient. Blocks of 10 were
      1.7x (1 thread) and 1.4x (2 threads) faster than one block of 100 at T = 128.

    Inputs: x (B, P); w (R·E, P, U) and b (R·E, U), the experts' stacked parameters; gw
    (R, T, E) the gate weights; y (B, T); block: repetitions per block. Output: the loss.
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, w: Tensor, b: Tensor, gw: Tensor, y: Tensor, block: int
    ) -> Tensor:
        reps, _, e = gw.shape
        need = any(ctx.needs_input_grad[1:4])
        grads = (torch.empty_like(w), torch.empty_like(b), torch.empty_like(gw)) if need else None
        loss = x.new_zeros(())
        for s in range(0, reps, block):
            r, ex = slice(s, s + block), slice(s * e, (s + block) * e)
            sub = None if grads is None else (grads[0][ex], grads[1][ex], grads[2][r])
            loss += _block_sse(x, w[ex], b[ex], gw[r], y, sub)
        if grads is not None:
            ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        d_w, d_b, d_gw = ctx.saved_tensors
        return None, d_w * g, d_b * g, d_gw * g, None, None


def mixture_loss(model: SyntheticMoE, xb: Tensor, yb: Tensor) -> Tensor:
    """Σ_r [Σ_t MSE_t,r + aux_r] of a batch through :class:`_MixtureSSE` (the fast path)."""
    out = model.gates()
    gw = out.weights.view(model.reps, model.num_tasks, model.num_experts)
    w, b = model.experts.weights[0], model.experts.biases[0]
    block = max(1, LOSS_BLOCK_WEIGHTS // (model.num_tasks * model.num_experts))
    return _MixtureSSE.apply(xb, w, b, gw, yb, block) + out.aux_loss
