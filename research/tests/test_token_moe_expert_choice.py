"""The token-MoE study's expert-choice router."""

from __future__ import annotations

import torch

from dselectk_research import token_moe as TM


def test_the_char_lm_router_builds_expert_choice_layers() -> None:
    hp = dict(TM.DEFAULTS, d_model=16, d_ff=16, heads=2, num_experts=4, seq_len=8)
    hp["renormalize"] = False  # the default (True) is token routing's only
    model = TM.build_model(TM.ROUTERS["expert_choice"], hp)
    assert all(m.routing == "expert" for m in model.moe_layers)
    assert TM.ROUTERS["expert_choice"].identity()["routing"] == "expert"
    assert "routing" not in TM.ROUTERS["topk"].identity()  # token routers keep their run ids
    logits, aux = model(torch.randint(0, 256, (3, 8)))
    assert logits.shape == (3, 8, 256) and torch.isfinite(aux)
