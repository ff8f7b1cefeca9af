"""A per-token mixture of experts inside a small transformer, with a DSelect-k router.

Each token of each sequence goes to at most 2 of 8 experts. The router settings are the ones
that measured best per token in this library's character-level study: no entropy regulariser
(the gate's default λ = 0) and the layer's top-2 weights renormalised.

    python examples/token_moe_transformer.py
"""

import torch
from torch import nn

from dselectk.layers import SparseMoEFeedForward

torch.manual_seed(0)
VOCAB, D_MODEL, SEQ = 32, 32, 16


class TinyMoETransformer(nn.Module):
    """Embedding, one self-attention block, a per-token MoE feed-forward block, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.attn = nn.MultiheadAttention(D_MODEL, num_heads=4, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        # the defaults: DSelect-k gate (λ = 0, 3 selectors), top-2 dispatch, renormalised
        self.moe = SparseMoEFeedForward(D_MODEL, 64, num_experts=8, gate="dselect_k", k=2)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(tokens)
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        a, _ = self.attn(self.norm1(h), self.norm1(h), self.norm1(h), attn_mask=causal)
        h = h + a
        moe = self.moe(self.norm2(h))  # routes every token: (batch, seq, d_model)
        return self.head(h + moe.output), moe.aux_loss  # aux: router regulariser + balance loss


# A toy language: each token is the previous one plus one (mod VOCAB), from a random start.
def batch(n: int = 16) -> torch.Tensor:
    start = torch.randint(0, VOCAB, (n, 1))
    return (start + torch.arange(SEQ + 1)) % VOCAB


model = TinyMoETransformer()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
for step in range(60):
    seq = batch()
    logits, aux = model(seq[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1)) + aux
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 20 == 0 or step == 59:
        print(f"step {step:3d}: loss {loss.item():.3f}")

load = model.moe.last_stats["load"]  # tokens routed to each expert in the last forward
print("tokens per expert in the last batch:", load.tolist())
assert loss.item() < 1.0
