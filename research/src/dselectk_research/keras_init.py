"""Initialisers: the Keras (TensorFlow 2) defaults the paper's reference models were built with.

The paper's models were written in TensorFlow 2 / Keras, whose layers initialise differently
from PyTorch's:

============================  ===================================  ==============================
layer                         Keras default                        PyTorch default
============================  ===================================  ==============================
``Embedding``                 U(−0.05, 0.05)                       N(0, 1)
``Dense``                     Glorot-uniform weights, zero bias    U(±1/√fan_in) weights and bias
``Conv2D``                    Glorot-uniform (receptive-field      U(±1/√fan_in) weights and bias
                              fans), zero bias
============================  ===================================  ==============================

Glorot-uniform draws from U(−limit, limit) with ``limit = √(6 / (fan_in + fan_out))``; for a
convolution with kernel k×k, ``fan_in = in_channels·k²`` and ``fan_out = out_channels·k²``.

:func:`keras_init_` re-initialises a module tree in place with these defaults. Stacked modules
(E experts or towers in one tensor) are initialised member by member with the fans of *one*
member's layer, exactly as E separate Keras layers would be. Gates keep their own
initialisation (the paper's, e.g. DSelect-k's U(−γ/100, γ/100)) unless ``gates=True``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dselectk.gates.base import Gate
from dselectk.layers.experts import StackedMLP
from dselectk_research.cnn import BatchedCNNExperts

__all__ = [
    "EMBEDDING_LIMIT",
    "INITS",
    "glorot_limit",
    "glorot_uniform_",
    "init_module_",
    "keras_init_",
]

#: Keras ``Embedding``'s default ``RandomUniform(-0.05, 0.05)``.
EMBEDDING_LIMIT = 0.05
#: names accepted by :func:`init_module_`
INITS = ("keras", "torch")


def glorot_limit(fan_in: int, fan_out: int) -> float:
    """``√(6 / (fan_in + fan_out))``, the bound of Glorot-uniform."""
    if fan_in < 1 or fan_out < 1:
        raise ValueError(f"fans must be >= 1, got fan_in={fan_in}, fan_out={fan_out}")
    return math.sqrt(6.0 / (fan_in + fan_out))


@torch.no_grad()
def glorot_uniform_(t: Tensor, fan_in: int, fan_out: int) -> Tensor:
    """Fill ``t`` in place from U(±``glorot_limit(fan_in, fan_out)``); returns ``t``."""
    limit = glorot_limit(fan_in, fan_out)
    return t.uniform_(-limit, limit)


def _conv_fans(weight: Tensor, groups: int = 1) -> tuple[int, int]:
    """Keras fans of a conv weight (out, in/groups, *k): one group is one Keras layer."""
    receptive = math.prod(weight.shape[2:])
    return weight.shape[1] * receptive, (weight.shape[0] // groups) * receptive


@torch.no_grad()
def _init_one(m: nn.Module) -> bool:
    """Initialise ``m``'s own parameters the Keras way; False when ``m`` is not a known layer."""
    if isinstance(m, nn.Embedding):
        m.weight.uniform_(-EMBEDDING_LIMIT, EMBEDDING_LIMIT)
        if m.padding_idx is not None:
            m.weight[m.padding_idx].zero_()
    elif isinstance(m, nn.Linear):
        glorot_uniform_(m.weight, m.in_features, m.out_features)
        if m.bias is not None:
            m.bias.zero_()
    elif isinstance(m, nn.modules.conv._ConvNd):
        glorot_uniform_(m.weight, *_conv_fans(m.weight, m.groups))
        if m.bias is not None:
            m.bias.zero_()
    elif isinstance(m, StackedMLP):
        for w, b in zip(m.weights, m.biases):  # w: (E, fan_in, fan_out), one member per row
            glorot_uniform_(w, w.shape[1], w.shape[2])
            b.zero_()
    elif isinstance(m, BatchedCNNExperts):
        # conv weights stack the E experts along the output channels: (E·c_out, c_in, k, k)
        e = m.num_members
        for w, b in ((m.conv1_weight, m.conv1_bias), (m.conv2_weight, m.conv2_bias)):
            glorot_uniform_(w, *_conv_fans(w, e))
            b.zero_()
        # its dense stack is a StackedMLP child, reached by the walk
    else:
        return False
    return True


@torch.no_grad()
def keras_init_(module: nn.Module, *, gates: bool = False) -> nn.Module:
    """Re-initialise ``module`` and its submodules in place with the Keras defaults.

    Embeddings: U(±0.05); ``nn.Linear``, ``nn.Conv*d``, :class:`StackedMLP` and
    :class:`BatchedCNNExperts`: Glorot-uniform weights (per member, with one member's fans) and
    zero biases. Other parameters (layer norms, static gate logits, ...) are left as they are.

    Args:
        module: the model (or any layer).
        gates: also re-initialise the linear layers inside :class:`~dselectk.gates.base.Gate`
            modules (default False: gates keep their own, the paper's, initialisation).

    Returns:
        ``module``.
    """
    stack = [module]
    while stack:
        m = stack.pop()
        if isinstance(m, Gate) and not gates:
            continue
        _init_one(m)
        stack.extend(m.children())
    return module


def init_module_(module: nn.Module, init: str) -> nn.Module:
    """Apply a named initialisation: "keras" (:func:`keras_init_`) or "torch" (leave PyTorch's
    defaults, i.e. do nothing). Returns ``module``."""
    if init == "keras":
        return keras_init_(module)
    if init == "torch":
        return module
    raise ValueError(f"init must be one of {INITS}, got {init!r}")
