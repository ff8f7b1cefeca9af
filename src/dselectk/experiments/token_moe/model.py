"""The token-MoE study's corpus (the Python standard library's source), its small character-level
transformer with :class:`~dselectk.layers.SparseMoEFeedForward` blocks, and one training run."""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dselectk.experiments.runner import progress_position
from dselectk.layers import SparseMoEFeedForward
from dselectk.telemetry import RoutingTelemetry
from dselectk.training import Callback, History, TaskData, TrainConfig, train

__all__ = ["CharMoETransformer", "Corpus", "load_corpus", "train_run"]

EXPERIMENT = "token-moe"
VOCAB = 256  # bytes: every Python source file is UTF-8, mostly ASCII (one byte per character)
GATES: dict[str, str] = {"dselect_k": "dselect_k", "topk": "topk"}
LABELS = {"dselect_k": "DSelect-k (per token)", "topk": "Top-k"}
#: the default study (``dselectk reproduce token-moe``)
DEFAULTS: dict[str, Any] = {
    "corpus_bytes": 1_500_000,
    "val_fraction": 0.1,
    "seq_len": 64,
    "d_model": 64,
    "layers": 2,
    "heads": 4,
    "d_ff": 128,
    "num_experts": 8,
    "k": 2,
    "batch_size": 32,
    "steps": 1000,
    "lr": 2e-3,
    "balance_loss_weight": 0.01,
    "gamma": 1.0,
    "entropy_reg": 0.01,
    "val_windows": 2048,
}


@dataclass
class Corpus:
    """Byte streams of the train and validation parts, and what was read."""

    train: Tensor
    val: Tensor
    files: list[str]
    """Paths relative to the stdlib folder, in reading order."""
    sha256: str
    """Hash of the file list (one relative path a line), identifying the corpus."""
    content_sha256: str
    """Hash of the bytes read."""
    root: str


def _stdlib_files(root: Path) -> list[Path]:
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(
    max_bytes: int = DEFAULTS["corpus_bytes"],
    val_fraction: float = DEFAULTS["val_fraction"],
    root: str | Path | None = None,
) -> Corpus:
    """The first ``max_bytes`` of the stdlib's ``*.py`` files (sorted by relative path, tests
    and site-packages left out, whole files), as bytes; the last ``val_fraction`` of the stream
    is the validation part (a fixed, contiguous split)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    names: list[str] = []
    total = 0
    for p in _stdlib_files(base):
        if total >= max_bytes:
            break
        data = p.read_bytes()
        chunks.append(data)
        names.append(p.relative_to(base).as_posix())
        total += len(data)
    if total == 0:
        raise ValueError(f"no *.py files under {base}")
    blob = b"".join(chunks)[:max_bytes]
    stream = torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()
    n_val = int(len(stream) * val_fraction)
    return Corpus(
        train=stream[: len(stream) - n_val],
        val=stream[len(stream) - n_val :],
        files=names,
        sha256=hashlib.sha256("\n".join(names).encode()).hexdigest(),
        content_sha256=hashlib.sha256(blob).hexdigest(),
        root=str(base),
    )


def windows(stream: Tensor, seq_len: int, limit: int | None = None) -> TaskData:
    """Non-overlapping windows: inputs (W, L), next-byte targets (W, L)."""
    w = (len(stream) - 1) // seq_len
    if limit is not None:
        w = min(w, limit)
    x = stream[: w * seq_len].view(w, seq_len)
    y = stream[1 : w * seq_len + 1].view(w, seq_len)
    return TaskData(x, [y])


class _Block(nn.Module):
    def __init__(self, hp: Mapping[str, Any], router: str) -> None:
        super().__init__()
        d = int(hp["d_model"])
        self.heads = int(hp["heads"])
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        kw = (
            {"gamma": hp["gamma"], "entropy_reg": hp["entropy_reg"]}
            if router == "dselect_k"
            else {}
        )
        self.moe = SparseMoEFeedForward(
            d,
            int(hp["d_ff"]),
            int(hp["num_experts"]),
            router,
            k=int(hp["k"]),
            balance_loss_weight=float(hp["balance_loss_weight"]),
            router_kwargs=kw,
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        out, aux = self.moe(self.ln2(x))
        return x + out, aux


class CharMoETransformer(nn.Module):
    """Byte-level causal transformer whose feed-forward layers are sparse MoE blocks."""

    def __init__(self, hp: Mapping[str, Any], router: str) -> None:
        super().__init__()
        d = int(hp["d_model"])
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(int(hp["seq_len"]), d) * 0.02)
        self.blocks = nn.ModuleList(_Block(hp, router) for _ in range(int(hp["layers"])))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.embed(x) + self.pos[: x.shape[1]]
        aux = h.new_zeros(())
        for blk in self.blocks:
            h, a = blk(h)
            aux = aux + a
        return self.head(self.ln_f(h)), aux


def _lm_loss(model: nn.Module, batch: TaskData) -> tuple[Tensor, Any]:
    logits, aux = model(batch.x)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), batch.ys[0].reshape(-1))
    return ce + aux, None


class _StepTimer(Callback):
    """Wall time of the optimizer steps (the first 10 are warm-up and not counted)."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.steps = 0

    def on_step(self, model: nn.Module, batch: TaskData, out: Any, history: History) -> None:
        if history.steps == 10:
            self.t0 = time.perf_counter()
            self.steps = 0
        elif self.t0 is not None:
            self.steps += 1

    def per_step(self) -> float:
        return (time.perf_counter() - self.t0) / self.steps if self.t0 and self.steps else math.nan


@torch.no_grad()
def evaluate_lm(model: CharMoETransformer, data: TaskData, batch: int = 256) -> dict[str, Any]:
    """Validation bits per byte, load per expert (per layer) and DSelect-k's binary tokens."""
    model.eval()
    blocks: list[Any] = list(model.blocks)
    n = int(blocks[0].moe.num_experts)
    loads = [torch.zeros(n) for _ in blocks]
    binary = [0.0 for _ in blocks]
    nonzero = [0.0 for _ in blocks]
    inputs: list[Tensor] = []
    hooks = [
        b.moe.router.register_forward_hook(lambda m, a, o: inputs.append(a[0])) for b in blocks
    ]
    total, tokens = 0.0, 0
    try:
        for i in range(0, len(data), batch):
            x, y = data.x[i : i + batch], data.ys[0][i : i + batch]
            inputs.clear()
            logits, _ = model(x)
            total += float(
                F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
            )
            tokens += y.numel()
            for j, blk in enumerate(blocks):
                stats = blk.moe.last_stats
                loads[j] += stats["load"].float()
                router = blk.moe.router
                w = router(inputs[j]).weights
                nonzero[j] += float((w > 0).sum())
                if router.binarizes:  # tokens whose S(Wx) is binary
                    binary[j] += float(router.binary_entries(inputs[j]).all(-1).sum())
    finally:
        for h in hooks:
            h.remove()
    model.train()
    is_dk = bool(blocks[0].moe.router.binarizes)
    fractions = [(ld / ld.sum()).tolist() for ld in loads]
    return {
        "val_bpc": total / tokens / math.log(2),
        "load": fractions,
        "load_max_over_mean": max(max(f) * n for f in fractions),
        "experts_per_token": sum(nonzero) / (tokens * len(loads)),
        "binary_token_fraction": sum(binary) / (tokens * len(loads)) if is_dk else None,
        "binary_token_fraction_per_layer": [b / tokens for b in binary] if is_dk else None,
    }


def train_run(
    router: str,
    hp: Mapping[str, Any],
    corpus: Corpus,
    seed: int,
    *,
    progress: bool,
    desc: str,
    telemetry_dir: Path | None = None,
) -> dict[str, Any]:
    """Train one model for ``hp["steps"]`` steps on random windows; returns its metrics.

    With ``telemetry_dir``, routing telemetry (:class:`~dselectk.telemetry.RoutingTelemetry`:
    binary fraction, experts per token, load, selector collisions, per router) is logged there
    20 times over the run (TensorBoard if installed, else JSON lines).
    """
    torch.manual_seed(seed)
    model = CharMoETransformer(hp, router)
    seq = int(hp["seq_len"])
    # random window starts (one draw per run seed), so every epoch sees other cuts of the text
    g = torch.Generator().manual_seed(seed)
    n_win = int(hp["steps"]) * int(hp["batch_size"])
    starts = torch.randint(0, len(corpus.train) - seq - 1, (n_win,), generator=g)
    idx = starts.unsqueeze(1) + torch.arange(seq + 1)
    chunks = corpus.train[idx]
    data = TaskData(chunks[:, :-1].contiguous(), [chunks[:, 1:].contiguous()])
    val = windows(corpus.val, seq, int(hp["val_windows"]))
    timer = _StepTimer()
    callbacks: list[Any] = [timer]
    if telemetry_dir is not None:
        every = max(1, int(hp["steps"]) // 20)
        callbacks.append(RoutingTelemetry(telemetry_dir, every=every, probe_size=16))
    cfg = TrainConfig(
        lr=float(hp["lr"]),
        batch_size=int(hp["batch_size"]),
        epochs=1,
        seed=None,
        shuffle_seed=seed,
        progress=progress,
        progress_unit="step",
        desc=desc,
        position=progress_position(),
    )
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    t0 = time.perf_counter()
    hist = train(model, data, None, cfg, callbacks=callbacks, loss_fn=_lm_loss)
    wall = time.perf_counter() - t0
    metrics = evaluate_lm(model, val)
    metrics.update(
        train_loss=hist.train_loss[-1] if hist.train_loss else math.nan,
        steps=hist.steps,
        seconds_per_step=timer.per_step(),
        train_seconds=wall,
        parameters=sum(p.numel() for p in model.parameters()),
        threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(),
        load_average_at_start=load_before,
    )
    return metrics
