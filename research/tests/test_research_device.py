"""Training steps of the research part's char-LM on a GPU equal the CPU's."""

from __future__ import annotations

import pytest
import torch

import dselectk as dk

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pair(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The module on the CPU and an exact copy on CUDA (float64 both)."""
    import copy

    cpu = module.double()
    return cpu, copy.deepcopy(cpu).to("cuda")


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().cpu() for n, p in module.named_parameters() if p.grad is not None}


def _assert_same_step(
    cpu: torch.nn.Module, gpu: torch.nn.Module, loss_of, rel: float = 1e-9, **tol: float
) -> None:  # type: ignore[no-untyped-def]
    """``loss_of(module, device)`` on both copies, backward, then the losses (``rel``) and every
    parameter's gradient (``tol``: assert_close's tolerances) compared."""
    losses = []
    for mod, dev in ((cpu, "cpu"), (gpu, "cuda")):
        loss = loss_of(mod, dev)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=rel)
    for key, g in _grads(cpu).items():
        torch.testing.assert_close(_grads(gpu)[key], g, msg=key, **tol)


@pytest.mark.gpu
@cuda
def test_char_lm_step_on_cuda_matches_cpu() -> None:
    from functools import partial

    from dselectk_research.char_lm import CharMoETransformer

    torch.manual_seed(8)
    model = CharMoETransformer(
        partial(dk.DSelectK, 8, k=2, in_features=32, distinct=True),
        seq_len=16,
        d_model=32,
        heads=2,
        layers=2,
        d_ff=48,
    )
    cpu, gpu = _pair(model)
    ids = torch.randint(0, 256, (4, 17))
    _assert_same_step(cpu, gpu, lambda mod, dev: mod.loss(ids[:, :-1].to(dev), ids[:, 1:].to(dev)))
