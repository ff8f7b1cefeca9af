"""Training steps of the research part's char-LM on a GPU equal the CPU's."""

from __future__ import annotations

import pytest
import torch

import dselectk as dk
from dselectk._testing import assert_same_step as _assert_same_step
from dselectk._testing import cuda_pair as _pair

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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
