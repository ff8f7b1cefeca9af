"""RowwiseAdam: the one Adam of the package with one learning rate per member."""

from __future__ import annotations

import pytest
import torch

from dselectk.optim import RowwiseAdam


def test_rowwise_adam_matches_torch_adam() -> None:
    """One row per member: each row follows its own torch.optim.Adam run."""
    gen = torch.Generator().manual_seed(0)
    a0 = torch.randn(3, 5, generator=gen)
    grads = [torch.randn(3, 5, generator=gen) for _ in range(6)]
    lrs = [0.01, 0.1, 0.001]
    a = torch.nn.Parameter(a0.clone())
    ours = RowwiseAdam([a], torch.tensor(lrs))
    for g in grads:
        a.grad = g.clone()
        ours.step()
    for i, lr in enumerate(lrs):
        c = torch.nn.Parameter(a0[i].clone())
        opt = torch.optim.Adam([c], lr=lr)
        for g in grads:
            c.grad = g[i].clone()
            opt.step()
        assert torch.allclose(a[i], c, rtol=1e-5, atol=1e-7)


def test_member_rows_equal_torch_adam() -> None:
    """Rows with learning rates 0.1 and 0.01 (3 rows per member) follow two torch.optim.Adam
    runs (the stacked parameters of a vectorized model)."""
    torch.manual_seed(0)
    p = torch.randn(6, 3, requires_grad=True)
    opt = RowwiseAdam([p], lr=[0.1, 0.01])
    refs = [p.detach().clone().requires_grad_() for _ in range(2)]
    ref_opts = [torch.optim.Adam([r], lr=v) for r, v in zip(refs, (0.1, 0.01), strict=True)]
    for _ in range(5):
        g = torch.randn(6, 3)
        p.grad = g.clone()
        opt.step()
        for r, o in zip(refs, ref_opts, strict=True):
            r.grad = g.clone()
            o.step()
    torch.testing.assert_close(p[:3], refs[0][:3].detach())
    torch.testing.assert_close(p[3:], refs[1][3:].detach())


def test_scalar_lr_equals_torch_adam_and_state_dict_round_trip() -> None:
    torch.manual_seed(1)
    w0 = torch.randn(4, 2)
    ours_p, ref_p = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ours, ref = RowwiseAdam([ours_p], lr=0.05), torch.optim.Adam([ref_p], lr=0.05)
    grads = [torch.randn(4, 2) for _ in range(8)]
    for i, g in enumerate(grads):
        ours_p.grad, ref_p.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        if i == 3:  # resume from a state_dict half-way: the same trajectory
            state = ours.state_dict()
            ours = RowwiseAdam([ours_p], lr=0.05)
            ours.load_state_dict(state)
    torch.testing.assert_close(ours_p, ref_p)


def test_bad_arguments_are_named() -> None:
    p = torch.nn.Parameter(torch.zeros(5, 2))
    with pytest.raises(ValueError, match="multiple of 2 rows"):
        RowwiseAdam([p], lr=[0.1, 0.2])
    with pytest.raises(ValueError, match="lr must hold finite values > 0"):
        RowwiseAdam([p], lr=[-0.1])
    with pytest.raises(ValueError, match="betas"):
        RowwiseAdam([p], lr=0.1, betas=(1.0, 0.9))
