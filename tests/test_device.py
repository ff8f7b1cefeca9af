"""Device-agnostic: the same numbers on an accelerator as on the CPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

import dselectk as dk
from dselectk.layers import StackedMLP
from dselectk.models import MultiGateMoE

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", dk.gate_names())
def test_gate_on_cuda_matches_cpu(name: str) -> None:
    kw = {} if name in ("softmax", "gumbel_softmax") else {"k": 2}
    torch.manual_seed(0)
    gate = dk.make_gate(name, 8, in_features=5, num_gates=2, **kw).double().eval()
    x = torch.randn(7, 5, dtype=torch.float64)
    cpu = gate(x)
    gpu = gate.to("cuda")(x.to("cuda"))
    torch.testing.assert_close(gpu.weights.cpu(), cpu.weights)
    torch.testing.assert_close(gpu.aux_loss.cpu(), cpu.aux_loss)


@pytest.mark.gpu
@cuda
def test_mmoe_step_on_cuda() -> None:
    model = MultiGateMoE(
        StackedMLP(8, 6, [16]), dk.DSelectK(8, 2, num_gates=2), StackedMLP(2, 16, [1])
    ).to("cuda")
    out = model(torch.randn(4, 6, device="cuda"))
    (sum(o.sum() for o in out.outputs) + out.aux_loss).backward()
    assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())
