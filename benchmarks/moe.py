"""Item ``moe``: the token MoE block's forward + backward against two baselines, same routing.

``SparseMoEFeedForward`` (router ``topk``, k = 2, GELU experts d_model -> d_ff -> d_model, no
balance loss) against

- ``grouped``: the straightforward implementation: the same Top-k router module, then a Python
  loop over the experts (``torch.where`` on the top-k indices, the expert's two ``nn.Linear`` on
  its rows, ``index_add_`` of the weighted result), as most tutorials write it;
- ``hf``: Hugging Face's ``MixtralSparseMoeBlock`` (softmax top-k router, SwiGLU experts with
  ``intermediate_size = 2 d_ff / 3`` so that its three matrices cost the two of ours), when
  ``transformers`` is importable.

- ``swiglu``: not a baseline but ours hosting the ``hf`` block's own router and SwiGLU experts
  (``SparseMoEFeedForward.from_hf_block``: the same weights, the same outputs): its row
  ``swiglu vs hf`` is the like-for-like speed-up over the Hugging Face block;
- ``experts``: our experts' grouped matmuls alone (``forward_grouped`` on N·k rows split as the
  router split them, fwd + bwd, no routing, gather or combine): the floor of a per-expert
  implementation; dense / experts is what the split into per-expert matmuls costs by itself;
- ``dense``: not an MoE but the floor under any exact one: the experts' GEMMs in one piece, a
  single GELU FFN of the same sizes over all N·k routed rows, forward + backward. Its row's
  ratio (dense / ours) is the share of that floor our layer reaches; hf / dense is the most any
  exact implementation could gain over the Hugging Face block on this machine;
- ``balanced``: not an MoE either but the ceiling of any per-expert one: our experts' weights as
  one batched matmul (``baddbmm``) over n equal blocks of N·k/n rows, forward + backward, no
  routing, gather or combine, and no block larger than another. Its row ``balanced vs dense``
  (dense / balanced) is the most of the dense floor that splitting the rows among n experts can
  keep with torch's GEMMs on this machine, however the layer dispatches.

Rows: ours' median, the baseline's median (interleaved), baseline / ours (> 1: we are faster)
and tokens/s. Float32, on the suite's thread count.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common import Report, row
from benchmarks.timing import compare
from dselectk.gates import TopKGate
from dselectk.layers.token_moe import SparseMoEFeedForward


class GroupedMoE(nn.Module):
    """A straightforward top-k MoE FFN: loop over experts, ``index_add_`` back (see above)."""

    def __init__(self, router: TopKGate, d_model: int, d_ff: int, n: int, k: int) -> None:
        super().__init__()
        self.router, self.k = router, k
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
            for _ in range(n)
        )

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        w = self.router(flat).weights  # (N, n)
        top_w, top_e = w.topk(self.k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, pos = torch.where(top_e == e)
            if tok.numel():
                out.index_add_(0, tok, expert(flat[tok]) * top_w[tok, pos, None])
        return out.reshape(x.shape)


def _hf_block(d_model: int, d_ff: int, n: int, k: int) -> nn.Module | None:
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except Exception:  # not installed, or an API change: the row is skipped
        return None
    cfg = MixtralConfig(
        hidden_size=d_model,
        intermediate_size=max(1, 2 * d_ff // 3),
        num_local_experts=n,
        num_experts_per_tok=k,
    )
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)
    return block


def _experts_only(layer: SparseMoEFeedForward, counts: list[int]) -> Any:
    """The layer's experts on rows already grouped as ``counts`` (no routing)."""

    def run(rows: Tensor) -> Tensor:
        return layer.experts.forward_grouped(rows, counts)

    return run


def _balanced(layer: SparseMoEFeedForward, rows: int) -> Any:
    """The layer's experts as one batched matmul per layer over equal row blocks (see above)."""
    experts = layer.experts
    n, last = experts.num_members, len(experts.weights) - 1
    if rows % n:
        raise ValueError(f"rows must be a multiple of the {n} experts, got {rows}")

    def run(x: Tensor) -> Tensor:
        h = x.view(n, rows // n, x.shape[-1])
        for i, (w, b) in enumerate(zip(experts.weights, experts.biases)):
            h = torch.baddbmm(b.unsqueeze(1), h, w)
            if i < last:
                h = F.gelu(h)
        return h.reshape(rows, -1)

    return run


def _step(fn: Any, x: Tensor, g: Tensor) -> Any:
    def run() -> None:
        out = fn(x)
        y = out.output if hasattr(out, "output") else out
        y.backward(g)

    return run


def run(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    d_model, d_ff, n, k = 256, 512, 8, 2
    reps = 5 if args.quick else 15
    rows = []
    for tokens in (256, 2048, 8192):
        if args.quick:
            reps = 5 if tokens < 8192 else 3
        torch.manual_seed(0)
        ours = SparseMoEFeedForward(d_model, d_ff, n, "topk", k, balance_weight=0.0).to(dev)
        assert isinstance(ours.gate, TopKGate)
        grouped = GroupedMoE(ours.gate, d_model, d_ff, n, k).to(dev)
        x = torch.randn(1, tokens, d_model, device=dev, requires_grad=True)
        g = torch.randn_like(x)
        dense = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        xk = torch.randn(tokens * k, d_model, device=dev, requires_grad=True)
        fns = {
            "ours": _step(ours, x, g),
            "grouped": _step(grouped, x, g),
            "dense": _step(dense.to(dev), xk, torch.randn_like(xk)),
        }
        counts = ours.route(x.detach().reshape(-1, d_model)).counts
        fns["experts"] = _step(_experts_only(ours, counts), xk, torch.randn_like(xk))
        fns["balanced"] = _step(_balanced(ours, tokens * k), xk, torch.randn_like(xk))
        hf = _hf_block(d_model, d_ff, n, k)
        if hf is not None:
            hf = hf.to(dev)
            fns["hf"] = _step(hf, x, g)
            swiglu = SparseMoEFeedForward.from_hf_block(hf, balance_weight=0.0)
            fns["swiglu"] = _step(swiglu, x, g)
        t = compare(fns, dev, reps=reps, warmup=2)
        cfg = {"tokens": tokens, "d_model": d_model, "d_ff": d_ff, "n": n, "k": k}
        pairs = [("ours", b) for b in ("grouped", "hf", "experts", "dense")]
        pairs += [("balanced", "dense")]
        pairs += [("swiglu", "hf")] if "hf" in t else []
        for mine, base in pairs:
            if base in t:
                label = (
                    f"N={tokens}: vs {base}" if mine == "ours" else f"N={tokens}: {mine} vs {base}"
                )
                r = row(label, t, mine, base, **cfg)
                r["ours_tokens_per_s"] = tokens / (t[mine]["median_ms"] / 1e3)
                r["base_tokens_per_s"] = tokens / (t[base]["median_ms"] / 1e3)
                if "hf" in t:
                    r["hf_over_dense"] = t["hf"]["median_ms"] / t["dense"]["median_ms"]
                rows.append(r)
    ceilings = ", ".join(
        f"{r['case'].split(':')[0]}: {r['hf_over_dense']:.2f}x"
        for r in rows
        if r["case"].endswith(": vs dense") and "hf_over_dense" in r
    )
    rep.table(
        "moe",
        "SparseMoEFeedForward fwd+bwd (top-k router, k=2) vs a grouped loop and HF Mixtral",
        rows,
        "target: >= 1.5x the Hugging Face block (ratio = base/ours); hf: SwiGLU, FLOP-matched; "
        "swiglu vs hf: ours hosting the hf block's weights; experts: our per-expert GEMMs alone; "
        "dense: the experts' GEMMs in one piece (ratio = the share of that floor reached; the "
        f"most any exact MoE could gain over hf here, hf / dense: {ceilings or 'n/a'}); "
        "balanced vs dense: the experts' GEMMs as one batched matmul on equal blocks, the most "
        "of the dense floor any per-expert split keeps here",
    )
