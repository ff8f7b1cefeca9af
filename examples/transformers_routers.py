"""DSelect-k routers in a tiny Mixtral, the transformers way (CPU, a few seconds).

Swaps the routers of a built model (``replace_routers``) and builds one with them from its
config (``with_routers`` + ``from_config``), trains a few steps, saves, reloads by name with
plain ``AutoModelForCausalLM.from_pretrained`` and checks the logits are the saved model's.
Needs ``pip install "dselectk[transformers]"``.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

from dselectk.integrations import hf  # importing it registers the classes with the auto classes


def main() -> None:
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    # 1. a model already built: swap its routers
    swapped = MixtralForCausalLM(config)
    hf.replace_routers(swapped, "dselect_k", gamma=0.5, entropy_reg=0.01)
    # 2. or build it with DSelect-k routers from the config
    model = AutoModelForCausalLM.from_config(hf.with_routers(config, "dselect_k", gamma=0.5))
    print("routers:", type(model.model.layers[0].mlp.gate.gate_module).__name__)

    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for step in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}")
    model.eval()

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            diff = (loaded(input_ids=ids).logits - model(input_ids=ids).logits).abs().max()
    print(f"reloaded by name: {type(loaded).__name__}, max logit difference {diff.item():.2e}")
    assert diff.item() <= 1e-6


if __name__ == "__main__":
    main()
