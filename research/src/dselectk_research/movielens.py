"""``dselectk reproduce movielens``: Section 4.1, Table 1, Table C.3, Table C.2 (Appendix D.1).

Two tasks per (user, movie) pair (following Wang et al., 2020): task 1, did the user watch
(rate) the movie (binary cross-entropy; negatives are sampled from movies the user has not
rated); task 2, the user's rating (squared error, negatives weighted 0: :func:`masked_mse`). The
loss is α·CE + (1 − α)·MSE for α ∈ {0.1, 0.5, 0.9}, trained with Adagrad and batch 128. Model
(Appendix D.1): an embedding bottom (:class:`MovieLensEmbedding`) feeding a multi-gate MoE with 8
experts (ReLU dense 256 + dropout 0.5) and per-task towers (ReLU dense 256 → 1); the
shared-bottom baseline shares one ReLU dense layer (units a hyperparameter) + dropout 0.5. The
choices where the paper is silent are explained in the report (``templates/movielens.md``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dselectk.layers.embedding import MovieLensEmbedding
from dselectk.layers.experts import StackedMLP
from dselectk.models.moe import MultiGateMoE, SharedBottom
from dselectk.training import TaskData
from dselectk_research import realdata as rd
from dselectk_research.args import (
    check_fits,
    int_at_least,
    physical_memory,
    probability,
    setting,
)
from dselectk_research.cnn import make_towers
from dselectk_research.data.movielens import MovieLensSplit
from dselectk_research.data.movielens.baselines import reference_metrics
from dselectk_research.runner import executor_from_args

NUM_EXPERTS = 8
ALPHAS = (0.1, 0.5, 0.9)
TASK_NAMES = ("task 1: watch (CE)", "task 2: rating (MSE)")
#: the paper's numbers: "table1" α → gate → (test loss × 10⁴, se, selected experts), "table_c3"
#: α → gate → (task-2 loss × 10⁴, se, task-1 accuracy %, se), "c2" (the MovieLens columns)
PAPER = rd.paper_numbers("movielens")

#: Hyperparameters of the quick default (values inside the Appendix D.1 grid, not tuned beyond
#: the learning rate). One epoch of the full ML-1M (12,503 steps of 128): ~15–20 ms per step on
#: one idle core, so the quick default (3 gates × 3 repetitions on ``--jobs 2 --threads 1``)
#: fits in ~30 minutes. The learning rate is the grid's value with the lowest *validation* loss
#: of static DSelect-k after this one epoch (seed 0, α = 0.5; val loss ×10⁴: lr 0.1 → 4337,
#: 0.2 → 4257, 0.3 → 4230): one epoch of Adagrad wants the largest step of the grid.
QUICK_LR = 0.3
_QUICK = {"lr": QUICK_LR, "epochs": 1}
QUICK_HPARAMS = rd.per_gate(
    {
        "dselect_k": {**_QUICK, "k": 2, "gamma": 1.0, "entropy_reg": 1.0},
        "topk": {**_QUICK, "k": 2},
        "gumbel_softmax": {**_QUICK, "sparsity_reg": 1e-3},
        "softmax": _QUICK,
        "shared_bottom": {**_QUICK, "units": 256},
    }
)
#: gates, α values and repetitions of the quick default (the others behind --gates / --alphas)
QUICK_GATES = ("dselect_k_static", "topk_static", "softmax")
QUICK_ALPHAS = (0.5,)
QUICK_REPS = 3
_OPT: dict[str, list[Any]] = {"lr": [0.001, 0.01, 0.1, 0.2, 0.3], "epochs": [5, 10, 20, 30, 40, 50]}
#: Appendix D.1 grid.
GRID = rd.per_gate(
    {
        "dselect_k": {**_OPT, "k": [2, 4], "entropy_reg": [0.1, 1, 10], "gamma": [1, 10]},
        "topk": {**_OPT, "k": [2, 4]},
        "gumbel_softmax": {**_OPT, "sparsity_reg": [10.0**e for e in range(-6, 2)]},
        "softmax": _OPT,
        "shared_bottom": {**_OPT, "units": [32, 256, 2048, 4096, 8192]},
    }
)


def masked_mse(pred: Tensor, y: Tensor) -> Tensor:
    """Task-2 loss: Σ mask·(pred − rating)² / B (Keras ``sample_weight`` semantics); ``pred``
    (B, 1), ``y`` (B, 2): the rating, then the observed-rating mask (0/1)."""
    err = pred.reshape(-1) - y[:, 0]
    return (err.square() * y[:, 1]).mean()


def build_model(gate: str, hp: Mapping[str, Any], meta: Mapping[str, Any]) -> nn.Module:
    """The Appendix D.1 model for ``gate`` (a name of ``realdata.VARIANTS``)."""
    bottom = MovieLensEmbedding(meta["num_users"], meta["num_items"], meta.get("side"))
    d = bottom.out_features
    choice = rd.VARIANTS[gate]
    if choice.variant is None:  # the shared bottom: one shared layer, no gate
        towers = make_towers(2, int(hp["units"]), (256, 1))
        shared = nn.Sequential(nn.Linear(d, int(hp["units"])), nn.ReLU(), nn.Dropout(0.5))
        return SharedBottom(shared, towers, bottom=bottom)
    towers = make_towers(2, 256, (256, 1))
    experts = StackedMLP(NUM_EXPERTS, d, [256], dropout=0.5, final_activation=True)
    gates = choice.build(NUM_EXPERTS, hp, num_gates=2, in_features=d)
    return MultiGateMoE(experts, gates, towers, bottom=bottom)


def expert_flops(hp: Mapping[str, Any], meta: Mapping[str, Any]) -> float:
    """Forward FLOPs of one expert (dense d → 256) on one example: 2·d·256."""
    return 2.0 * float(meta["bottom_features"]) * 256


def _task_weights(alpha: Any) -> list[float]:
    return [float(alpha), 1.0 - float(alpha)]


@dataclass(frozen=True)
class MovieLensConfig(rd.RealDataConfig):
    """What a ``reproduce movielens`` command computes (the flags of the same names)."""

    variant: str = setting("ml-1m", "ml-1m: the paper's", choices=["ml-100k", "ml-1m"])
    alphas: tuple[float, ...] = setting(  # an absent --alphas: resolved by ``run``
        QUICK_ALPHAS, "α values (default: 0.5; with --full all)", type=probability, default=None
    )
    neg_ratio: int = setting(1, "negatives per rating", type=int_at_least(1))
    max_train: int | None = setting(None, "training examples", type=int_at_least(1))
    no_side_features: bool = setting(False, "user and movie ids only")

    @property
    def settings(self) -> tuple[Any, ...]:
        return self.alphas


#: ratings (positives) of each variant: the GroupLens releases
RATINGS = {"ml-100k": 100_000, "ml-1m": 1_000_209}
#: bytes per example of the loaded data: user and item ids (int64), two float32 labels, side
#: features (age, gender, occupation int64; 18 float32 genres), held twice while the loader's
#: arrays are packed into tensors
BYTES_PER_EXAMPLE = 2 * (8 + 8 + 4 + 4 + 3 * 8 + 18 * 4)


def data_bytes(variant: str, neg_ratio: int, side: bool = True) -> int:
    """Estimated memory of the negative-sampled data set (every split): each rating and its
    ``neg_ratio`` sampled negatives are one example each."""
    per = BYTES_PER_EXAMPLE - (0 if side else 2 * (3 * 8 + 18 * 4))
    return RATINGS.get(variant, RATINGS["ml-1m"]) * (1 + int(neg_ratio)) * per


def check_memory(config: MovieLensConfig, total: int | None = None) -> None:
    """Refuse, before loading, a ``--neg-ratio`` whose data would not fit in memory (``total``,
    default the machine's; :func:`~dselectk_research.args.check_fits`)."""
    total = physical_memory() if total is None else total  # looked up here: tests patch it
    need = data_bytes(config.variant, config.neg_ratio, not config.no_side_features)
    what = (
        f"argument --neg-ratio {config.neg_ratio}: the {config.variant} training data "
        f"({RATINGS.get(config.variant, 0):,} ratings x {1 + config.neg_ratio} examples each)"
    )
    check_fits(need, what, total)


def load_data(args: MovieLensConfig) -> rd.Splits:
    """The two-task MovieLens splits, with their data config (the files' checksums included:
    a run made from other data never counts as done)."""
    from dselectk_research.data import load_movielens

    side = not args.no_side_features
    data = load_movielens(
        args.data_dir, variant=args.variant, neg_ratio=args.neg_ratio, seed=args.seed,
        side_features=side,
    )  # fmt: skip

    def pack(split: Any) -> TaskData:
        cols = [split.user, split.item]
        if side:
            cols += [split.user_age, split.user_gender, split.user_occupation]
        x = torch.stack(cols, dim=1).to(torch.int64)
        if side:
            x = torch.cat([x, split.item_genres.round().to(torch.int64)], dim=1)
        y2 = torch.stack([split.rating.float(), split.rating_mask.float()], dim=1)
        return TaskData(x, [split.watched.float(), y2])

    train, val, test = (pack(s) for s in (data.train, data.val, data.test))
    if args.max_train is not None and args.max_train < len(train):
        train = train.batch(torch.arange(args.max_train))  # already shuffled by the loader
    sizes = (data.num_age_buckets, data.num_genders, data.num_occupations, data.num_genres)
    meta: dict[str, Any] = {
        "num_users": data.num_users,
        "num_items": data.num_items,
        "side": sizes if side else None,
        "variant": args.variant,
        "ratings_source": data.ratings_source,
        "num_ratings": data.num_ratings,
        "n_train": len(train),
        "n_val": len(val),
        "n_test": len(test),
        "test_positive_fraction": float(data.test.rating_mask.float().mean()),
        "data_fingerprint": data.fingerprint,
    }
    meta["bottom_features"] = MovieLensEmbedding(1, 1, meta["side"]).out_features
    config = {
        "variant": args.variant,
        "neg_ratio": args.neg_ratio,
        "side_features": side,
        "seed": args.seed,
        "max_train": args.max_train,
        "ratings_source": data.ratings_source,
        "fingerprint": data.fingerprint,
    }
    return rd.Splits(train, val, test, meta, config)


def notes(args: MovieLensConfig, data: rd.Splits) -> dict[str, Any]:
    """The values of the report's "Setup and choices" (``templates/movielens.md``)."""
    m = data.meta
    side = ", age bucket (4), gender (2), occupation (4), genres (multi-hot → linear 8)"
    return dict(
        variant=args.variant,
        variant_note=" instead of ML-1M"
        if args.variant == "ml-100k"
        else " (the paper's data set)",
        ratings_source=m["ratings_source"],
        neg_ratio=args.neg_ratio,
        **{k: f"{m[k]:,}" for k in ("num_ratings", "n_train", "n_val", "n_test")},
        positive_fraction=f"{m['test_positive_fraction']:.2f}",
        side_inputs="" if args.no_side_features else side,
        bottom_features=m["bottom_features"],
        lr_note=f"lr {args.lr:g}, set by --lr"
        if args.lr
        else f"lr {QUICK_LR:g}: the grid's value with the lowest validation loss of static "
        "DSelect-k after one epoch, seed 0",
    )


def reference(args: MovieLensConfig, data: rd.Splits) -> dict[str, Any]:
    """The non-neural reference predictors on the run's splits
    (:mod:`dselectk_research.data.movielens.baselines`)."""

    def pairs(d: TaskData) -> MovieLensSplit:
        y2 = d.ys[1]
        return MovieLensSplit(d.x[:, 0], d.x[:, 1], d.ys[0].reshape(-1), y2[:, 0], y2[:, 1])

    train, val, test = (pairs(d) for d in (data.train, data.val, data.test))
    return reference_metrics(train, val, test, data.meta["num_users"], data.meta["num_items"])


def experiment() -> rd.Experiment:
    return rd.Experiment(
        name="movielens",
        setting_key="alpha",
        losses=["bce", masked_mse],
        task_names=TASK_NAMES,
        optimizer="adagrad",
        batch_size=128,
        quick_hparams=QUICK_HPARAMS,
        grid=GRID,
        select="min_loss",
        build_model=build_model,
        task_weights=_task_weights,
        expert_flops=expert_flops,
        load_data=load_data,
        data_fields=("data_dir", "variant", "seed", "neg_ratio", "no_side_features", "max_train"),
        template="movielens",
        notes=notes,
        title="MovieLens",
        tables=_tables,
        paper_c2=PAPER["c2"],
        c2_column="MovieLens α={}",
        quick_reps=QUICK_REPS,
        reference=reference,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    rd.add_common_arguments(p, "results/movielens", MovieLensConfig)


def run(args: argparse.Namespace) -> int:
    alphas = args.alphas if args.alphas is not None else (ALPHAS if args.full else QUICK_ALPHAS)
    config = rd.config_of(
        MovieLensConfig, args, QUICK_GATES, alphas=tuple(dict.fromkeys(float(a) for a in alphas))
    )
    check_memory(config)  # before loading: a --neg-ratio that cannot fit is refused at once
    return rd.run_experiment(experiment(), config, executor_from_args(args, threads=args.threads))


# -- report -----------------------------------------------------------------------------------
#: report labels of the non-neural reference predictors (``data.movielens.baselines``)
REFERENCE_LABELS = {
    "popularity_biases": "*Non-neural: item popularity + user/item biases*",
    "constant": "*Constant predictor*",
}
#: the report's tables: title, header, columns (see ``realdata.gate_rows``), paper numbers
TABLES = (
    (
        "Table 1: test loss (× 10⁴) and number of selected experts",
        "| gate | loss: ours | loss: paper | experts: ours | experts: paper |",
        [("test_loss", 1e4, 0, 0, ".0f", True), ("selected_experts", 1, 2, 2, ".1f", False)],
        "table1",
    ),
    (
        "Table C.3: task-2 test loss (× 10⁴) and task-1 test accuracy (%)",
        "| gate | T2 loss: ours | T2 loss: paper | T1 accuracy: ours | T1 accuracy: paper |",
        [
            ("test_loss_task2", 1e4, 0, 0, ".0f", True),
            ("test_accuracy_task1", 100, 2, 2, ".2f", True),
        ],
        "table_c3",
    ),
)


def _tables(
    rows: Mapping[tuple[Any, str], Mapping[str, Any]],
    settings: Sequence[Any],
    ref: Mapping[str, Any] | None,
) -> list[str]:
    md: list[str] = []
    for title, header, cols, table in TABLES:
        md += [f"## {title}", ""]
        for a in settings:
            md += [f"### α = {a}", "", header, "|---|---|---|---|---|"]
            md += rd.gate_rows(rows, a, cols, PAPER[table].get(str(float(a)), {}))
            for key, label in REFERENCE_LABELS.items():  # the non-neural predictors' test rows
                if not ref or key not in ref:
                    continue
                t = ref[key]["test"]
                if table == "table_c3":
                    acc = 100 * t["accuracy_task1"]
                    md.append(f"| {label} | {1e4 * t['loss_task2']:.0f} | - | {acc:.2f} | - |")
                else:
                    loss = float(a) * t["loss_task1"] + (1 - float(a)) * t["loss_task2"]
                    md.append(f"| {label} | {1e4 * loss:.0f} | - | - | - |")
            md.append("")
    return md


def write_report(results_dir: Path) -> None:
    """Rebuild ``summary.json``, ``report.md`` and the plots of a MovieLens results folder."""
    rd.write_report(Path(results_dir), experiment())
