"""Item ``train_step``: steps/s of the paper's models against a plain PyTorch MMoE (issue 25).

Full optimizer steps (forward + backward + Adam step, ``foreach=True`` for both sides, lr 1e-3,
training mode, one fixed synthetic batch of the right shapes and dtypes: no data files) of

- ``movielens``: the model ``dselectk reproduce movielens`` trains
  (:func:`dselectk_research.movielens.build_model` at its quick defaults: ML-1M vocabularies
  with side features, 8 ReLU dense-256 experts with dropout 0.5, a bank of 2 static DSelect-k
  gates (k = 2), towers 256 → 1, batch 128; loss α·BCE + (1 − α)·masked MSE + aux, α = 0.5) and
  the same model with per-example DSelect-k gates. (The experiment itself trains with Adagrad;
  both sides get the same Adam here.)
- ``c1``: the Appendix C.1 model (a :class:`~dselectk.models.MoEBank` of one repetition,
  T = 128 tasks, E = T/4 = 32 experts of the generator's form, static DSelect-k gates, k = 4,
  the tuned γ and λ, batch 256), with the loss the library trains it with (the fused
  :meth:`~dselectk.models.MoEBank.loss`) and with the model's forward + an autograd loss.

against the straightforward form popular recommender libraries ship (DeepCTR-Torch's and
torch-rechub's MMoE): experts as ``nn.Sequential`` modules in an ``nn.ModuleList`` run in a Python
loop, one dense softmax gate per task (``nn.Linear`` on the input for MovieLens, a static logit
vector for C.1), an ``einsum`` combine and per-task tower modules; same sizes, same loss.

With the suite's ``--compile``: ``torch.compile`` of the library model (forward and backward;
the optimizer step stays eager) and of the baseline, timed in the same rounds; a compile error
is one printed line, in the table's note, and its rows are left out. Rows: our median ms, the
baseline's (interleaved rounds, one process), baseline / ours = steps/s ours / steps/s baseline
(> 1: we are faster), both steps/s, threads and the 1-minute load average before and after; on
1 thread and on the suite's thread count (``--threads``; default torch's).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common import Report, load_average, row
from benchmarks.timing import compare
from dselectk.layers.embedding import EMBED_DIMS
from dselectk.models import MoEBank
from dselectk_research import movielens
from dselectk_research.data.synthetic import FEATURES, UNITS
from dselectk_research.synthetic.spec import BATCH_SIZE as C1_BATCH
from dselectk_research.synthetic.spec import K as C1_K
from dselectk_research.synthetic.spec import load_tuned, resolve_hparams
from dselectk_research.synthetic.train import build_model

__all__ = ["ML_META", "PlainC1MoE", "PlainMovieLensMMoE", "run"]

#: ML-1M's vocabularies (users and movies with a rating; age buckets, genders, occupations,
#: genres), what ``movielens.load_data`` passes to ``build_model``
ML_META: dict[str, Any] = {"num_users": 6040, "num_items": 3706, "side": (7, 2, 21, 18)}
ALPHA = 0.5
LR = 1e-3
C1_TASKS = 128

Step = Callable[[], object]


# ---------------------------------------------------------------------------------------------
# the baselines: what a recommender library's MMoE looks like
# ---------------------------------------------------------------------------------------------
class PlainMovieLensMMoE(nn.Module):
    """A plain PyTorch MMoE on the MovieLens inputs: the same embedding bottom (one
    ``nn.Embedding`` per id column, a linear layer on the genres), E expert modules in a loop,
    per-example softmax gates ``nn.Linear(d, E)`` per task, ``einsum`` combine, tower modules."""

    def __init__(
        self, num_users: int, num_items: int, side: tuple[int, ...], experts: int = 8
    ) -> None:
        super().__init__()
        ages, genders, occs, genres = side
        self.user = nn.Embedding(num_users, EMBED_DIMS["user"])
        self.item = nn.Embedding(num_items, EMBED_DIMS["item"])
        self.age = nn.Embedding(ages, EMBED_DIMS["age"])
        self.gender = nn.Embedding(genders, EMBED_DIMS["gender"])
        self.occupation = nn.Embedding(occs, EMBED_DIMS["occupation"])
        self.genres = nn.Linear(genres, EMBED_DIMS["genres"])
        d = sum(EMBED_DIMS.values())
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 256), nn.ReLU(), nn.Dropout(0.5)) for _ in range(experts)
        )
        self.gates = nn.ModuleList(nn.Linear(d, experts) for _ in range(2))
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)) for _ in range(2)
        )

    def forward(self, x: Tensor) -> tuple[list[Tensor], Tensor]:
        h = torch.cat(
            [
                self.user(x[:, 0]),
                self.item(x[:, 1]),
                self.age(x[:, 2]),
                self.gender(x[:, 3]),
                self.occupation(x[:, 4]),
                self.genres(x[:, 5:].float()),
            ],
            dim=-1,
        )
        e = torch.stack([expert(h) for expert in self.experts], dim=1)  # (B, E, 256)
        outs = []
        for gate, tower in zip(self.gates, self.towers):
            w = F.softmax(gate(h), dim=-1)  # (B, E)
            outs.append(tower(torch.einsum("be,bed->bd", w, e)))
        return outs, h.new_zeros(())


class PlainC1MoE(nn.Module):
    """A plain PyTorch multi-gate MoE of the C.1 form: E experts ``ReLU(Linear(10, 4))`` summed
    over their units, one static softmax gate (E logits) per task, ``einsum`` combine."""

    def __init__(self, tasks: int, experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(FEATURES, UNITS), nn.ReLU()) for _ in range(experts)
        )
        self.gates = nn.ParameterList(nn.Parameter(torch.zeros(experts)) for _ in range(tasks))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        f = torch.stack([e(x).sum(-1) for e in self.experts], dim=1)  # (B, E)
        w = torch.stack([F.softmax(g, dim=-1) for g in self.gates])  # (T, E)
        return torch.einsum("be,te->tb", f, w), x.new_zeros(())  # (T, B)


# ---------------------------------------------------------------------------------------------
# models, batches and steps
# ---------------------------------------------------------------------------------------------
def movielens_model(gate: str, dev: torch.device) -> nn.Module:
    """``movielens.build_model`` at the quick defaults of ``gate``, in training mode."""
    torch.manual_seed(0)
    hp = movielens.QUICK_HPARAMS[gate]
    return movielens.build_model(gate, hp, ML_META).to(dev).train()


def movielens_batch(batch: int, dev: torch.device) -> tuple[Tensor, list[Tensor]]:
    """Synthetic inputs of ``_pack``'s layout: int64 (user, item, age, gender, occupation,
    18 multi-hot genres); targets watched (B,) and (rating, mask) (B, 2)."""
    g = torch.Generator().manual_seed(1)
    users, items, (ages, genders, occs, genres) = ML_META["num_users"], ML_META["num_items"], (
        ML_META["side"]
    )  # fmt: skip
    cols = [torch.randint(n, (batch, 1), generator=g) for n in (users, items, ages, genders, occs)]
    cols.append(torch.randint(2, (batch, genres), generator=g))
    x = torch.cat(cols, dim=1)
    watched = torch.randint(2, (batch,), generator=g).float()
    rating = torch.randint(1, 6, (batch,), generator=g).float() * watched
    y2 = torch.stack([rating, watched], dim=1)
    return x.to(dev), [watched.to(dev), y2.to(dev)]


def movielens_loss(outs: list[Tensor], aux: Tensor, ys: list[Tensor]) -> Tensor:
    """α·BCE(task 1) + (1 − α)·masked MSE(task 2) + aux, the experiment's training loss."""
    bce = F.binary_cross_entropy_with_logits(outs[0].reshape(-1), ys[0])
    return ALPHA * bce + (1 - ALPHA) * movielens.masked_mse(outs[1], ys[1]) + aux


def c1_model(dev: torch.device) -> MoEBank:
    """The C.1 model at T = 128 with the shipped tuned hyperparameters, one repetition."""
    hp = resolve_hparams("dselect_k", C1_TASKS, load_tuned(), {})
    return build_model("dselect_k", C1_TASKS, hp, [0], k=C1_K).to(dev).train()


def c1_batch(dev: torch.device) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(C1_BATCH, FEATURES, generator=g)
    return x.to(dev), torch.randn(C1_BATCH, C1_TASKS, generator=g).to(dev)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=LR, foreach=True)


def optimizer_step(
    model: nn.Module, loss_of: Callable[[nn.Module], Tensor], fn: nn.Module | None = None
) -> Step:
    """zero_grad, ``loss_of(fn or model)``, backward, Adam step (over ``model``'s parameters)."""
    opt = adam(model)
    target = fn if fn is not None else model

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(target).backward()
        opt.step()

    return step


def _outputs(out: Any) -> tuple[list[Tensor], Tensor]:
    return (out.outputs, out.aux_loss) if hasattr(out, "outputs") else out


def _compiled(
    name: str,
    model: nn.Module,
    loss_of: Callable[[nn.Module], Tensor],
    fns: dict[str, Step],
    key: str,
) -> str:
    """Add ``fns[key]``: the step of ``torch.compile(model)``, warmed up; the compile time as
    text, or on failure one printed line and that line (no entry)."""
    t0 = time.perf_counter()
    try:
        compiled = torch.compile(model)
        step = optimizer_step(model, loss_of, compiled)  # type: ignore[arg-type]
        for _ in range(3):
            step()
    except Exception as e:  # any backend failure is reported, not fatal
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        print(f"   torch.compile({name}) failed: {msg}")
        return f"failed ({msg})"
    fns[key] = step
    took = time.perf_counter() - t0
    print(f"   torch.compile({name}): {took:.1f} s to compile and warm up")
    return f"{took:.0f} s"


@dataclass
class Family:
    """One model's contenders: name -> step, the (case, ours, baseline) rows, the config."""

    model: str
    fns: dict[str, Step]
    pairs: list[tuple[str, str, str]]
    config: dict[str, Any]


def _movielens(dev: torch.device, args: argparse.Namespace, notes: dict[str, str]) -> Family:
    batch = movielens.experiment().batch_size
    x, ys = movielens_batch(batch, dev)

    def loss_of(m: nn.Module) -> Tensor:
        return movielens_loss(*_outputs(m(x)), ys)

    torch.manual_seed(0)
    base = PlainMovieLensMMoE(**ML_META).to(dev).train()
    static = movielens_model("dselect_k_static", dev)
    per_example = movielens_model("dselect_k_per_example", dev)
    fns: dict[str, Step] = {
        "ours": optimizer_step(static, loss_of),
        "ours_per_example": optimizer_step(per_example, loss_of),
        "base": optimizer_step(base, loss_of),
    }
    pairs = [
        ("static DSelect-k (k=2) vs softmax gates", "ours", "base"),
        ("per-example DSelect-k (k=2) vs softmax gates", "ours_per_example", "base"),
    ]
    if args.compile:
        ours_c = movielens_model("dselect_k_static", dev)
        notes["movielens ours"] = _compiled("movielens ours", ours_c, loss_of, fns, "ours_c")
        torch.manual_seed(0)
        plain = PlainMovieLensMMoE(**ML_META).to(dev).train()
        notes["movielens base"] = _compiled("movielens base", plain, loss_of, fns, "base_c")
        pairs += [
            ("compiled static DSelect-k vs softmax gates", "ours_c", "base"),
            ("compiled static DSelect-k vs compiled softmax gates", "ours_c", "base_c"),
        ]
    return Family("movielens", fns, pairs, {"batch": batch, "experts": 8, "tasks": 2})


def _c1(dev: torch.device, args: argparse.Namespace, notes: dict[str, str]) -> Family:
    x, y = c1_batch(dev)

    def fused(m: nn.Module) -> Tensor:
        assert isinstance(m, MoEBank)
        return m.loss(x, y, fused=True)

    def composed(m: nn.Module) -> Tensor:
        pred, aux = m(x)  # (R, T, B) or (T, B)
        return (pred - y.T).square().mean(-1).sum() + aux

    ours = c1_model(dev)
    e = ours.num_experts
    torch.manual_seed(0)
    base = PlainC1MoE(C1_TASKS, e).to(dev).train()
    fns: dict[str, Step] = {
        "ours": optimizer_step(ours, fused),
        "ours_autograd": optimizer_step(c1_model(dev), composed),
        "base": optimizer_step(base, composed),
    }
    pairs = [
        ("static DSelect-k, fused loss vs softmax gates", "ours", "base"),
        ("static DSelect-k, autograd loss vs softmax gates", "ours_autograd", "base"),
    ]
    if args.compile:
        notes["c1 ours"] = _compiled("c1 ours", c1_model(dev), composed, fns, "ours_c")
        torch.manual_seed(0)
        plain = PlainC1MoE(C1_TASKS, e).to(dev).train()
        notes["c1 base"] = _compiled("c1 base", plain, composed, fns, "base_c")
        pairs += [
            ("compiled DSelect-k (autograd loss) vs softmax gates", "ours_c", "base"),
            ("compiled DSelect-k vs compiled softmax gates", "ours_c", "base_c"),
        ]
    return Family("c1", fns, pairs, {"batch": C1_BATCH, "tasks": C1_TASKS, "experts": e, "k": C1_K})


def thread_counts(dev: torch.device) -> list[int]:
    """1 and the suite's thread count (CPU), or the suite's alone (GPU, or 1 already)."""
    n = torch.get_num_threads()
    return sorted({1, n}) if dev.type == "cpu" else [n]


def measure(family: Family, threads: int, reps: int, dev: torch.device) -> list[dict[str, Any]]:
    """The family's rows on ``threads`` intra-op threads (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        load = load_average()
        t = compare(family.fns, dev, reps=reps, warmup=min(3, reps))
        load_after = load_average()
    finally:
        torch.set_num_threads(before)
    rows = []
    for case, ours, base in family.pairs:
        if ours not in t or base not in t:  # a compile that failed: said in the table's note
            continue
        cfg = {**family.config, "threads": threads, "load": f"{load}->{load_after}"}
        r = row(f"{family.model} threads={threads}: {case}", t, ours, base, **cfg)
        r.update(
            model=family.model,
            ours_steps_per_s=1e3 / r["ours_ms"],
            base_steps_per_s=1e3 / r["base_ms"],
            threads=threads,
            load_avg_1m=load,
            load_avg_1m_after=load_after,
        )
        rows.append(r)
    return rows


def run(rep: Report, dev: torch.device, args: argparse.Namespace) -> None:
    reps = getattr(args, "step_reps", 0) or (10 if args.quick else 40)
    notes: dict[str, str] = {}
    families = [_movielens(dev, args, notes), _c1(dev, args, notes)]
    rows = [r for th in thread_counts(dev) for fam in families for r in measure(fam, th, reps, dev)]
    note = "baseline: ModuleList experts in a loop, one softmax gate per task, einsum combine"
    if notes:
        note += "; torch.compile (compile + warm-up): " + ", ".join(
            f"{k} {v}" for k, v in notes.items()
        )
    rep.table(
        "train_step",
        "training step (fwd + bwd + Adam), the paper's MovieLens MMoE and the C.1 model vs a "
        "plain PyTorch MMoE with dense softmax gates; ratio = steps/s ours / steps/s baseline",
        rows,
        note,
    )
    for r in rows:
        print(
            f"   {r['case']}: {r['ours_steps_per_s']:.1f} vs {r['base_steps_per_s']:.1f} "
            f"steps/s ({r['ratio']:.2f}x), load {r['load_avg_1m']}->{r['load_avg_1m_after']}"
        )
