"""``dselectk reproduce multi-mnist|multi-fashion``: Section 4.2, Table 2, Table C.2 (App. D.2).

Multi-MNIST / Multi-Fashion-MNIST (two items overlaid on a 36×36 canvas, shifted 4 pixels to the
top-left and to the bottom-right): task 1 classifies the top-left item, task 2 the bottom-right
one. Model (Appendix D.2): a multi-gate MoE with 8 CNN experts (conv 5×5×10 + max-pool,
conv 5×5×20 + max-pool, a stack of ReLU dense layers of 50 units) evaluated as one batched module
(:class:`~dselectk_research.cnn.BatchedCNNExperts`), per-task towers dense 50-50-10, the summed
cross-entropy of the two tasks, Adam, batch 256. The shared-bottom baseline shares one CNN.
Per-example gates see the raw image (flattened to 1,296 features), as the experts do.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from dselectk.models.moe import MultiGateMoE, SharedBottom
from dselectk.training import TaskData
from dselectk_research import realdata as rd
from dselectk_research.args import check_fits, int_at_least, setting
from dselectk_research.cnn import BatchedCNNExperts, SingleCNN, make_towers
from dselectk_research.records import RunStore
from dselectk_research.runner import executor_from_args

NUM_EXPERTS = 8
IMAGE_SHAPE = (1, 36, 36)
#: experiment → (data kind, report title, Table C.2 column)
KINDS = {
    "multi-mnist": ("mnist", "Multi-MNIST", "Multi-MNIST"),
    "multi-fashion": ("fashion-mnist", "Multi-Fashion-MNIST", "Multi-Fashion"),
}
#: the paper's numbers: "table2" experiment → gate → (accuracy 1 %, se, accuracy 2 %, se,
#: selected experts), "c2" (the image columns of Table C.2)
PAPER = rd.paper_numbers("multi_mnist")

#: Quick default: 12,800 training images × 8 epochs = 400 steps of 256 per run (was 71, then
#: 200). Measured on the 2-core CPU with ``--jobs 2 --threads 1``: the 7 gates × 1 repetition
#: took 1,377 s (Multi-MNIST) and 1,208 s (Multi-Fashion), inside the 30-minute budget, with
#: conditional computation skipping the experts no sparse gate uses; ``--dry-run`` prints the
#: estimate for another machine. The hyperparameters are untuned, inside the Appendix D.2 grid
#: (λ of DSelect-k is not in that grid and is fixed at 0.1).
_BASE = {"lr": 1e-3, "epochs": 8, "dense_layers": 1}
QUICK_HPARAMS = rd.per_gate(
    {
        "dselect_k": {**_BASE, "k": 2, "gamma": 0.1, "entropy_reg": 0.1},
        "topk": {**_BASE, "k": 4},
        "gumbel_softmax": {**_BASE, "sparsity_reg": 1e-2},
        "softmax": _BASE,
        "shared_bottom": _BASE,
    }
)
_OPT: dict[str, list[Any]] = {
    "lr": [1e-2, 1e-3, 1e-4, 1e-5],
    "epochs": [25, 50, 75, 100],
    "dense_layers": [1, 3, 5],
}
#: Appendix D.2 grid.
GRID = rd.per_gate(
    {
        "dselect_k": {**_OPT, "k": [2, 4], "gamma": [0.1, 1, 10]},
        "topk": {**_OPT, "k": [2, 4]},
        "gumbel_softmax": {**_OPT, "sparsity_reg": [0.0, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 1000.0]},
        "softmax": _OPT,
        "shared_bottom": _OPT,
    }
)
#: (train, val, test) images of the quick default and of ``--full`` (the config's fields SIZES)
QUICK_SIZES, FULL_SIZES = (12_800, 1000, 2000), (100_000, 20_000, 20_000)
SIZES = ("n_train", "n_val", "n_test")
#: bytes per composed image while the splits are built: the uint8 36x36 image, its float32
#: copy and the flattened float32 rows the models read
BYTES_PER_IMAGE = 36 * 36 * (1 + 4 + 4)


def build_model(gate: str, hp: Mapping[str, Any], meta: Mapping[str, Any]) -> nn.Module:
    """The Appendix D.2 model for ``gate`` (inputs: images flattened to (B, 1296))."""
    layers = int(hp["dense_layers"])
    towers = make_towers(2, 50, (50, 50, 10))
    if rd.VARIANTS[gate].variant is None:  # the shared bottom: one shared CNN, no gate
        return SharedBottom(SingleCNN(image_shape=IMAGE_SHAPE, dense_layers=layers), towers)
    experts = BatchedCNNExperts(NUM_EXPERTS, IMAGE_SHAPE, dense_layers=layers)
    pixels = IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
    gates = rd.VARIANTS[gate].build(NUM_EXPERTS, hp, num_gates=2, in_features=pixels)
    return MultiGateMoE(experts, gates, towers)


def expert_flops(hp: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> float:
    """Forward FLOPs (2 per multiply-add) of one CNN expert on one 36×36 image.

    conv1 5×5×1→10 on 32×32 outputs: 2·10·25·32·32 = 512,000; conv2 5×5×10→20 on 12×12:
    2·20·250·144 = 1,440,000; dense 720→50: 72,000, and 50→50 (5,000) per extra layer.
    Pooling, ReLU and biases are not counted.
    """
    conv1 = 2 * 10 * 25 * 1 * 32 * 32
    conv2 = 2 * 20 * 25 * 10 * 12 * 12
    dense = 2 * 720 * 50 + (int(hp["dense_layers"]) - 1) * 2 * 50 * 50
    return float(conv1 + conv2 + dense)


def _size(split: int, what: str) -> Any:
    """The setting of a split's image count (an absent flag: resolved by ``run``)."""
    quick, full = QUICK_SIZES[split], FULL_SIZES[split]
    help_text = f"{what} images (default: {quick}; with --full {full})"
    return setting(quick, help_text, type=int_at_least(1), default=None)


@dataclass(frozen=True)
class MultiMNISTConfig(rd.RealDataConfig):
    """What a ``reproduce multi-mnist|multi-fashion`` command computes (the flags of the same
    names; ``experiment_name`` is the command's)."""

    experiment_name: str = "multi-mnist"
    n_train: int = _size(0, "training")
    n_val: int = _size(1, "validation")
    n_test: int = _size(2, "test")


def check_memory(config: MultiMNISTConfig, total: int | None = None) -> None:
    """Refuse, before loading, ``--n-train/--n-val/--n-test`` whose images would not fit in
    memory (:func:`~dselectk_research.args.check_fits`; ``total``: the machine's)."""
    what = (
        f"arguments --n-train/--n-val/--n-test ({config.n_train:,} + {config.n_val:,} + "
        f"{config.n_test:,} images)"
    )
    n = config.n_train + config.n_val + config.n_test
    check_fits(n * BYTES_PER_IMAGE, what, total)


def load_data(args: MultiMNISTConfig) -> rd.Splits:
    """The splits as flattened-image task data, with their data config (the files' checksums
    included: a run made from other data never counts as done)."""
    from dselectk_research.data import load_multi_mnist

    kind = KINDS[args.experiment_name][0]
    d = load_multi_mnist(args.data_dir, kind, args.n_train, args.n_val, args.n_test, seed=args.seed)

    def pack(s: Any) -> TaskData:
        return TaskData(s.X.reshape(len(s), -1).contiguous(), [s.y1, s.y2])

    n = {k: getattr(args, k) for k in SIZES}
    meta = {"kind": kind, **n, "data_fingerprint": d.fingerprint}
    config = {"kind": kind, **n, "seed": args.seed, "fingerprint": d.fingerprint}
    return rd.Splits(pack(d.train), pack(d.val), pack(d.test), meta, config)


def notes(args: MultiMNISTConfig, data: rd.Splits) -> dict[str, Any]:
    """The values of the report's "Setup and choices" (``templates/multi_mnist.md``)."""
    sizes = {k: f"{getattr(args, k):,}" for k in SIZES}
    return {"title": KINDS[args.experiment_name][1], **sizes}


def experiment(name: str) -> rd.Experiment:
    _, title, c2_column = KINDS[name]
    return rd.Experiment(
        name=name,
        setting_key=None,
        losses=["ce", "ce"],
        task_names=("task 1: top-left item", "task 2: bottom-right item"),
        optimizer="adam",
        batch_size=256,
        quick_hparams=QUICK_HPARAMS,
        grid=GRID,
        select="max_accuracy",
        build_model=build_model,
        expert_flops=expert_flops,
        load_data=load_data,
        data_fields=("data_dir", "experiment_name", "seed", *SIZES),
        template="multi_mnist",
        notes=notes,
        title=title,
        tables=functools.partial(_tables, name),
        paper_c2={c2_column: PAPER["c2"][c2_column]},
        c2_column=c2_column,
        quick_reps=1,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    name = p.get_default("experiment_name") or "multi-mnist"
    rd.add_common_arguments(p, f"results/{name}", MultiMNISTConfig)


def run(args: argparse.Namespace) -> int:
    name = str(getattr(args, "experiment_name", "multi-mnist"))
    out = args.out
    if out == Path("results/multi-mnist") and name != "multi-mnist":  # (a parser not from the CLI)
        out = Path(f"results/{name}")
    defaults = FULL_SIZES if args.full else QUICK_SIZES
    n: dict[str, Any] = {k: getattr(args, k) or d for k, d in zip(SIZES, defaults)}
    config = rd.config_of(MultiMNISTConfig, args, out=out, experiment_name=name, **n)
    check_memory(config)  # before loading: image counts that cannot fit are refused at once
    executor = executor_from_args(args, threads=args.threads)
    return rd.run_experiment(experiment(name), config, executor)


# -- report -----------------------------------------------------------------------------------
def _tables(
    name: str,
    rows: Mapping[tuple[Any, str], Mapping[str, Any]],
    settings: Sequence[Any],
    reference: Any,
) -> list[str]:
    md = [
        f"## Table 2 ({KINDS[name][1]}): test accuracy (%) and number of selected experts",
        "",
        "| gate | accuracy 1: ours | paper | accuracy 2: ours | paper | experts: ours | paper |",
        "|---|---|---|---|---|---|---|",
    ]
    cols = [
        ("test_accuracy_task1", 100, 2, 0, ".2f", True),
        ("test_accuracy_task2", 100, 2, 2, ".2f", True),
        ("selected_experts", 1, 2, 4, "g", False),
    ]
    md += rd.gate_rows(rows, None, cols, PAPER["table2"][name])
    md += ["", "Training throughput (examples/s, mean over runs):", ""]
    for g in rd.VARIANTS:
        if (None, g) in rows:
            speed = rd.fmt(rows[(None, g)]["metrics"].get("examples_per_second"), 1, 0)
            md.append(f"- {rd.diverged_label(rows[(None, g)])}: {speed}")
    return md


def write_report(results_dir: Path) -> None:
    """Rebuild ``summary.json``, ``report.md`` and the plots from the run records alone (the
    experiment, Multi-MNIST or Multi-Fashion, read from the records)."""
    names = {r["config"].get("experiment") for r in RunStore(results_dir).load()}
    name = "multi-fashion" if "multi-fashion" in names else "multi-mnist"
    rd.write_report(Path(results_dir), experiment(name))
