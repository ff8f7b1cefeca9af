"""R independent multi-gate MoEs with static gates, trained as one vectorized model.

A study that repeats a small multi-task model R times (repetitions, or the configurations of a
grid search) trains all of them as one :class:`MoEBank`: the R·E experts are one
:class:`~dselectk.layers.StackedMLP` (one batched matmul), the R·T static gates one gate bank,
and the loss one (R, T, B) squared error. The members share nothing but the input batch, so with
an elementwise optimizer (Adam, :class:`~dselectk.optim.RowwiseAdam` for per-member learning
rates) the bank follows the trajectories of R separate models. Each member keeps the
initialisation it gets alone when the bank is loaded with
:func:`~dselectk.variants.stack_members`::

    from dselectk.gates import make_gate
    from dselectk.layers import StackedMLP
    from dselectk.models import MoEBank
    from dselectk.variants import stack_members

    experts, gates = [], []
    for seed in seeds:  # member r: the parameters a model built under this seed gets alone
        torch.manual_seed(seed)
        experts.append(StackedMLP(8, 10, [4], final_activation=True))
        gates.append(make_gate("dselect_k", 8, k=4, num_gates=32))
    bank = MoEBank(
        stack_members(StackedMLP(len(seeds) * 8, 10, [4], final_activation=True), experts),
        stack_members(make_gate("dselect_k", 8, k=4, num_gates=len(seeds) * 32), gates),
        members=len(seeds),
    )
    loss = bank.loss(x, y)  # y: (B, 32); Σ_r [Σ_t MSE_t,r + aux_r]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from dselectk.gates.base import Gate, check_positive_int
from dselectk.layers.experts import StackedMLP

__all__ = ["LOSS_BLOCK_WEIGHTS", "BankOutput", "MoEBank"]

#: size of a block of the fused loss, in gate weights (members × T × E): 10 members at T = 128
#: (E = 32), all 100 at T <= 32. A block's (R, B, T) residual and (B, U, R·E) activations are
#: then about 1.3 MB each and stay in the CPU caches.
LOSS_BLOCK_WEIGHTS = 40_960


class BankOutput(NamedTuple):
    """Output of :class:`MoEBank`.

    Examples:
        >>> from dselectk import DSelectK, MoEBank
        >>> from dselectk.layers import StackedMLP
        >>> bank = MoEBank(StackedMLP(3 * 4, 10, [4]), DSelectK(4, k=2, num_gates=3 * 2), 3)
        >>> outputs, aux_loss = bank(torch.randn(5, 10))
        >>> tuple(outputs.shape), aux_loss.dim()  # (members, tasks, batch), scalar
        ((3, 2, 5), 0)
    """

    outputs: Tensor
    """(R, T, B): member r's prediction of task t for each example."""
    aux_loss: Tensor
    """Scalar: the summed auxiliary loss of all R·T gates."""


class MoEBank(nn.Module):
    """R independent multi-gate MoEs (T tasks, E scalar experts each) with static gates.

    Member r owns experts r·E ... r·E + E − 1 of ``experts`` and gates r·T ... r·T + T − 1 of
    ``gates``; its prediction for task t is Σ_e w[r, t, e] f_{r,e}(x), where an expert's
    output f is the sum of its last layer's units (a last layer of width 1: the unit itself).

    Args:
        experts: a :class:`~dselectk.layers.StackedMLP` of R·E members.
        gates: a bank of R·T static gates choosing among E experts.
        members: R.

    Examples:
        Three members, each with 4 experts and 2 tasks:

        >>> from dselectk import DSelectK, MoEBank
        >>> from dselectk.layers import StackedMLP
        >>> bank = MoEBank(StackedMLP(3 * 4, 10, [4]), DSelectK(4, k=2, num_gates=3 * 2), members=3)
        >>> x, y = torch.randn(5, 10), torch.randn(5, 2)  # (batch, in), (batch, tasks)
        >>> tuple(bank(x).outputs.shape), bank.loss(x, y).dim()  # (R, T, B), summed loss
        ((3, 2, 5), 0)
        >>> tuple(bank.inference_weights().shape)  # (R, T, E)
        (3, 2, 4)
    """

    def __init__(self, experts: StackedMLP, gates: Gate, members: int) -> None:
        super().__init__()
        members = check_positive_int("members", members)
        if not isinstance(gates, Gate):
            raise TypeError(f"gates must be a dselectk Gate bank, got {type(gates).__name__}")
        if not isinstance(getattr(experts, "num_members", None), int):
            raise TypeError(
                f"experts must be an expert bank (dselectk.layers.StackedMLP), got "
                f"{type(experts).__name__}"
            )
        if experts.num_members % members:
            raise ValueError(
                f"experts has {experts.num_members} members, not a multiple of members={members}"
            )
        if not gates.static or gates.num_gates is None or gates.num_gates % members:
            raise ValueError(
                f"gates must be a bank of static gates, a multiple of members={members} "
                f"(num_gates={gates.num_gates}, static={gates.static})"
            )
        self.members, self.num_tasks = members, gates.num_gates // members
        self.num_experts = experts.num_members // members
        if gates.num_experts != self.num_experts:
            raise ValueError(
                f"gates choose among {gates.num_experts} experts, each member has "
                f"{self.num_experts}"
            )
        self.experts, self.gates = experts, gates

    def _members_view(self, w: Tensor) -> Tensor:
        return w.view(self.members, self.num_tasks, self.num_experts)

    def expert_outputs(self, x: Tensor) -> Tensor:
        """(R, E, B): every expert of every member on the shared batch (one batched op)."""
        return self.experts(x).sum(-1).view(self.members, self.num_experts, -1)

    def forward(self, x: Tensor, weights: Tensor | None = None) -> BankOutput:
        """A :class:`BankOutput`: predictions (R, T, B) and the summed auxiliary loss of all R·T
        gates (a named tuple: ``pred, aux = bank(x)`` still unpacks); ``weights`` ((R, T, E) or
        (R·T, E)) replaces the gates' (then the auxiliary loss is 0)."""
        if weights is None:
            out = self.gates()
            weights, aux = out.weights, out.aux_loss
        else:
            shapes = ((self.members, self.num_tasks, self.num_experts),
                      (self.members * self.num_tasks, self.num_experts))  # fmt: skip
            if tuple(weights.shape) not in shapes:
                raise ValueError(
                    f"weights must have shape {shapes[0]} or {shapes[1]} (members, tasks, "
                    f"experts), got {tuple(weights.shape)}"
                )
            aux = x.new_zeros(())
        return BankOutput(torch.bmm(self._members_view(weights), self.expert_outputs(x)), aux)

    @torch.no_grad()
    def inference_weights(self) -> Tensor:
        """(R, T, E): the weights used at evaluation (:meth:`Gate.inference_weights`: the
        gate's post-hoc rule applied, e.g. the ablation gates' argmax)."""
        return self._members_view(self.gates.inference_weights())

    @torch.no_grad()
    def expert_weights(self) -> Tensor:
        """(R, T, E): the gates' own (soft) weights."""
        return self._members_view(self.gates.expert_weights())

    @torch.no_grad()
    def mse(self, x: Tensor, y: Tensor, weights: Tensor, chunk: int = 1024) -> Tensor:
        """(R,) float64 MSE of each member with the gate ``weights`` (R, T, E), averaged over
        tasks and examples; ``x`` (N, in), ``y`` (N, T); evaluated ``chunk`` rows at a time."""
        total = torch.zeros(self.members, dtype=torch.float64)
        flat = weights.reshape(-1, self.num_experts)
        for s in range(0, x.shape[0], chunk):
            pred, _ = self(x[s : s + chunk], flat)
            err = (pred - y[s : s + chunk].T.unsqueeze(0)) ** 2
            total += err.sum((1, 2)).double()
        return total / (x.shape[0] * self.num_tasks)

    @property
    def fusable(self) -> bool:
        """Whether :meth:`loss` takes the fused path: one-layer ReLU experts, no dropout."""
        e = self.experts
        one_relu_layer = len(e.weights) == 1 and e.activation == "relu" and e.final_activation
        return one_relu_layer and (e.dropout == 0.0 or not self.training)

    def loss(self, x: Tensor, y: Tensor, *, fused: bool | None = None) -> Tensor:
        """Σ_r [Σ_t MSE_t,r + aux_r] of a batch (task losses summed, members summed): ``x`` (B,
        in) shared by all members, ``y`` (B, T).

        ``fused`` (default: when :attr:`fusable`) computes it by one autograd node,
        :class:`_MixtureSSE`, with the same value and gradients as the composed
        ``(self(x)[0] - y.T).square().mean(-1).sum() + aux`` (``fused=False``).
        """
        if fused is None:
            fused = self.fusable
        if not fused:
            pred, aux = self(x)
            return (pred - y.T.unsqueeze(0)).square().mean(-1).sum() + aux
        if not self.fusable:
            raise ValueError("the fused loss needs one-layer ReLU experts without dropout")
        out = self.gates()
        gw = self._members_view(out.weights)
        w, b = self.experts.weights[0], self.experts.biases[0]
        block = max(1, LOSS_BLOCK_WEIGHTS // (self.num_tasks * self.num_experts))
        return _MixtureSSE.apply(x, w, b, gw, y, block) + out.aux_loss


def _block_sse(
    x: Tensor, w: Tensor, b: Tensor, gw: Tensor, y: Tensor, grads: tuple[Tensor, ...] | None
) -> Tensor:
    """Σ (pred - y)² / B of one block of members; writes its gradients into ``grads``."""
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
    """Σ_r Σ_t MSE_t,r of R banked one-layer MoEs, from the inputs to the loss in one node.

    Same value and gradients as :meth:`MoEBank.forward` followed by
    ``(pred - y).square().mean(-1).sum()`` (tested against it, float64 gradcheck too), laid out
    for the CPU:

    * all R·E experts of a block are **one** (B, P) @ (P, U·R·E) matmul (the input is shared,
      so no batched matmul of narrow matrices), and the unit sum runs over a leading axis;
    * the squared error is one subtraction and one dot product, and the backward pass is
      written out (one multiply for d loss / d pred, ``threshold_backward`` for the ReLU, two
      matmuls for the expert weights);
    * because the output is a scalar, the gradients are computed **in the forward pass**, block
      by block of members (:data:`LOSS_BLOCK_WEIGHTS`), while each block's activations are
      still in cache; ``backward`` only scales them by the incoming gradient. Blocks of 10 were
      1.7x (1 thread) and 1.4x (2 threads) faster than one block of 100 at T = 128, E = 32.

    Inputs: x (B, P); w (R·E, P, U) and b (R·E, U), the experts' stacked parameters; gw
    (R, T, E) the gate weights; y (B, T); block: members per block. Output: the loss.
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
