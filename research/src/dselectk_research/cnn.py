"""CNN experts and towers of the Multi-MNIST / Multi-Fashion-MNIST experiments (Appendix D.2).

Each expert of the paper's multi-gate MoE is a CNN: conv 5×5 with 10 filters (ReLU) + 2×2
max-pool, conv 5×5 with 20 filters (ReLU) + 2×2 max-pool, then a stack of ReLU dense layers of 50
units (the number of layers is a hyperparameter, {1, 3, 5}). The task towers are dense 50-50-10.

:class:`BatchedCNNExperts` evaluates E such CNNs as *one* module: the E experts' filters are stacked
into one weight tensor per layer; conv1 is one convolution with E·10 output channels (equal to a
grouped convolution with ``groups=E`` over the input repeated E times, without the copy), conv2
is a grouped convolution (``groups=E``) and the dense stack is a batched matmul. This is
mathematically identical to E separate CNNs (tested) and much faster on CPUs than a Python loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dselectk.gates.base import check_positive_int
from dselectk.layers.experts import StackedMLP, make_towers

__all__ = [
    "BatchedCNNExperts",
    "SingleCNN",
    "load_from_reference",
    "make_reference_cnn",
    "make_towers",
]


def _conv_out(size: int, kernel: int) -> int:
    """Side after a valid convolution and a 2×2 max-pool."""
    return (size - kernel + 1) // 2


class BatchedCNNExperts(nn.Module):
    """E CNN experts of Appendix D.2 evaluated together with grouped convolutions.

    Args:
        num_members: E, the number of experts (8 in the paper).
        image_shape: (channels, height, width) of one input image; (1, 36, 36) for
            Multi-MNIST.
        conv_channels: filters of the two convolutions, (10, 20) in the paper.
        kernel_size: 5 in the paper.
        dense_layers: number of ReLU dense layers after the convolutions ({1, 3, 5}).
        dense_units: units of each dense layer (50 in the paper).
        flat_input: accept inputs flattened to (B, C·H·W) (so that per-example gates, which take
            2-D inputs, can see the same tensor as the experts); (B, C, H, W) is accepted too.

    Attributes:
        num_members: E (the expert-bank interface of :class:`~dselectk.models.MultiGateMoE`).
        out_features: ``dense_units``.
    """

    def __init__(
        self,
        num_members: int = 8,
        image_shape: Sequence[int] = (1, 36, 36),
        *,
        conv_channels: Sequence[int] = (10, 20),
        kernel_size: int = 5,
        dense_layers: int = 1,
        dense_units: int = 50,
        flat_input: bool = True,
    ) -> None:
        super().__init__()
        self.num_members = check_positive_int("num_members", num_members)
        c, h, w = (int(s) for s in image_shape)
        self.image_shape = (c, h, w)
        c1, c2 = (check_positive_int("conv_channels[i]", v) for v in conv_channels)
        self.kernel_size = check_positive_int("kernel_size", kernel_size)
        check_positive_int("dense_layers", dense_layers)
        self.flat_input = bool(flat_input)
        self.channels_last = False  # channels-last memory for conv2 (same result; opt-in)
        self.channels = (c, c1, c2)
        e = num_members
        # Stacked filters: expert i owns output channels [i*c1, (i+1)*c1) of conv1, etc.
        self.conv1_weight = nn.Parameter(torch.empty(e * c1, c, kernel_size, kernel_size))
        self.conv1_bias = nn.Parameter(torch.empty(e * c1))
        self.conv2_weight = nn.Parameter(torch.empty(e * c2, c1, kernel_size, kernel_size))
        self.conv2_bias = nn.Parameter(torch.empty(e * c2))
        side_h = _conv_out(_conv_out(h, kernel_size), kernel_size)
        side_w = _conv_out(_conv_out(w, kernel_size), kernel_size)
        if side_h < 1 or side_w < 1:
            raise ValueError(f"image_shape {tuple(image_shape)} is too small for two conv+pool")
        self.flat_features = c2 * side_h * side_w
        self.dense = StackedMLP(
            e, self.flat_features, [dense_units] * dense_layers, final_activation=True
        )
        self.out_features = int(dense_units)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """PyTorch's Conv2d default initialisation, expert by expert (same fan-in)."""
        for wt, b in ((self.conv1_weight, self.conv1_bias), (self.conv2_weight, self.conv2_bias)):
            fan_in = wt.shape[1] * wt.shape[2] * wt.shape[3]
            bound = 1.0 / math.sqrt(fan_in)
            wt.uniform_(-bound, bound)
            b.uniform_(-bound, bound)
        self.dense.reset_parameters()

    def _images(self, x: Tensor) -> Tensor:
        if x.dim() == 2:
            return x.view(x.shape[0], *self.image_shape)
        if x.dim() == 4 and tuple(x.shape[1:]) == self.image_shape:
            return x
        raise ValueError(
            f"x must be (B, {math.prod(self.image_shape)}) or (B, {self.image_shape}), "
            f"got {tuple(x.shape)}"
        )

    def forward(self, x: Tensor, members: Tensor | None = None) -> Tensor:
        """Evaluate the experts (all, or only ``members``).

        Args:
            x: (B, C·H·W) or (B, C, H, W) images shared by all experts.
            members: optional (E',) expert indices (conditional computation: the others cost
                nothing, forward or backward).

        Returns:
            (E', B, dense_units).
        """
        img = self._images(x)
        _, c1, c2 = self.channels
        w1: Tensor = self.conv1_weight
        b1: Tensor = self.conv1_bias
        w2: Tensor = self.conv2_weight
        b2: Tensor = self.conv2_bias
        if members is not None:
            idx = members.to(torch.long)
            w1 = w1.view(self.num_members, c1, *w1.shape[1:])[idx].flatten(0, 1)
            b1 = b1.view(self.num_members, c1)[idx].flatten()
            w2 = w2.view(self.num_members, c2, *w2.shape[1:])[idx].flatten(0, 1)
            b2 = b2.view(self.num_members, c2)[idx].flatten()
        e = w1.shape[0] // c1
        # conv1 of all experts at once: a grouped conv (groups=E) over the input repeated E times
        # equals one ordinary conv with the E experts' filters stacked along the output
        # channels (every expert sees all input channels), which skips the copy.
        h = F.max_pool2d(F.relu(F.conv2d(img, w1, b1)), 2)  # (B, E·c1, h1, w1)
        if self.channels_last:
            h = h.contiguous(memory_format=torch.channels_last)
        h = F.max_pool2d(F.relu(F.conv2d(h, w2, b2, groups=e)), 2)  # (B, E·c2, h2, w2)
        h = h.reshape(h.shape[0], e, self.flat_features).transpose(0, 1)  # (E, B, F)
        return self.dense(h, members)

    def extra_repr(self) -> str:
        _, c1, c2 = self.channels
        return (
            f"num_members={self.num_members}, image_shape={self.image_shape}, "
            f"conv=({c1}, {c2}), kernel_size={self.kernel_size}, "
            f"dense={len(self.dense.weights)}x{self.out_features}"
        )


class SingleCNN(nn.Module):
    """One CNN of Appendix D.2 returning (B, dense_units): the shared-bottom network.

    Args:
        **kwargs: as :class:`BatchedCNNExperts` (without ``num_members``).
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self.cnn = BatchedCNNExperts(1, **kwargs)  # type: ignore[arg-type]
        self.out_features = self.cnn.out_features

    def forward(self, x: Tensor) -> Tensor:
        return self.cnn(x)[0]


def make_reference_cnn(
    image_shape: Sequence[int] = (1, 36, 36),
    conv_channels: Sequence[int] = (10, 20),
    kernel_size: int = 5,
    dense_layers: int = 1,
    dense_units: int = 50,
) -> nn.Sequential:
    """A plain ``nn.Sequential`` CNN expert (used to test :class:`BatchedCNNExperts`)."""
    c, h, w = image_shape
    c1, c2 = conv_channels
    side = _conv_out(_conv_out(h, kernel_size), kernel_size) * _conv_out(
        _conv_out(w, kernel_size), kernel_size
    )
    layers: list[nn.Module] = [
        nn.Conv2d(c, c1, kernel_size),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, kernel_size),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    ]
    fin = c2 * side
    for _ in range(dense_layers):
        layers += [nn.Linear(fin, dense_units), nn.ReLU()]
        fin = dense_units
    return nn.Sequential(*layers)


@torch.no_grad()
def load_from_reference(bank: BatchedCNNExperts, cnns: Sequence[nn.Sequential]) -> None:
    """Copy the weights of E :func:`make_reference_cnn` networks into ``bank`` (for tests)."""
    if len(cnns) != bank.num_members:
        raise ValueError(f"need {bank.num_members} CNNs, got {len(cnns)}")
    _, c1, c2 = bank.channels
    for i, net in enumerate(cnns):
        convs = [m for m in net if isinstance(m, nn.Conv2d)]
        lins = [m for m in net if isinstance(m, nn.Linear)]
        bank.conv1_weight[i * c1 : (i + 1) * c1] = convs[0].weight
        assert convs[0].bias is not None and convs[1].bias is not None
        bank.conv1_bias[i * c1 : (i + 1) * c1] = convs[0].bias
        bank.conv2_weight[i * c2 : (i + 1) * c2] = convs[1].weight
        bank.conv2_bias[i * c2 : (i + 1) * c2] = convs[1].bias
        for w, b, lin in zip(bank.dense.weights, bank.dense.biases, lins):
            w[i] = lin.weight.T
            b[i] = lin.bias
