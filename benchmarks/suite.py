"""The benchmark suite of issue 5: one table per item, ours vs a baseline timed side by side.

Items (``--only`` takes these names; each is a module of this package with a
``run(rep, dev, args)`` function):

- ``small_batch``: per-example DSelect-k vs Top-k forward + backward at B = 1, 16, 256, 4096 on
  1 and 2 threads, side by side; then (table ``small_batch_contention``) on 2 threads in blocks
  of idle then beside 3 busy processes, busy / idle (``--no-contention`` skips that part).
- ``contention``: the per-example gate's forward + backward at B = 1, 16, 256, 4096 and a small
  MMoE training step, idle and beside 3 busy processes the item starts itself, on 2 threads and
  under the package's thread policy (``dselectk.runtime.thread_policy``); busy / idle per row.
- ``gate``: per-example DSelect-k forward + backward (B = 4096, p = 64, n = 128, k = 4) against
  the product-table formulation of the paper's formulas and against a Top-k gate, at
  initialisation and in a sparse regime (~30 % of the bits exactly 0 or 1).
- ``bank``: T static gates as one ``num_gates=T`` module vs T separate modules, T = 2, 16, 128.
- ``mmoe``: a MovieLens-architecture multi-gate MoE training step vs a straightforward PyTorch
  MMoE (experts in a Python loop, one gate module per task, default Adam).
- ``conditional``: training step with binary static gates vs the dense step; per-example routing
  at inference vs a dense model of only the selected experts (and vs all experts).
- ``memory``: peak memory of the per-example gate at B = 4096, n = 1024, k = 4 (subprocess).
- ``scaling``: gate cost against n and B.
- ``moe``: the token MoE block (``SparseMoEFeedForward``, Top-k router) forward + backward vs a
  straightforward grouped loop and Hugging Face's ``MixtralSparseMoeBlock``.
- ``train_step``: full training steps (fwd + bwd + Adam) of the paper's MovieLens MMoE and of the
  C.1 model vs a plain PyTorch MMoE with dense softmax gates, steps/s and their ratio (with
  ``--compile``, ``torch.compile`` of both models too).
- ``synthetic`` (only with ``--synthetic``): wall time of ``benchmarks/bench_synthetic.py``.

Every table row holds our median, the baseline's median (measured interleaved in the same
process), baseline / ours (> 1: we are faster) and the configuration. Results go to JSON, and
each run appends one line to ``benchmarks/results/history.jsonl`` (machine, threads, load
average, git commit, every row's ratio); ``python -m benchmarks.readme_tables`` prints the
README's Markdown tables from its last line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import REPO_ROOT, Report
from benchmarks.timing import machine_facts
from dselectk._argtypes import int_at_least
from dselectk.runtime import tune_allocator
from dselectk_research.args import out_dir as out_folder

REGISTRY: dict[str, str] = {
    "small_batch": "benchmarks.small_batch",
    "contention": "benchmarks.contention",
    "gate": "benchmarks.gate",
    "bank": "benchmarks.bank",
    "mmoe": "benchmarks.mmoe",
    "conditional": "benchmarks.conditional",
    "memory": "benchmarks.memory",
    "scaling": "benchmarks.scaling",
    "moe": "benchmarks.moe",
    "train_step": "benchmarks.train_step",
    "synthetic": "benchmarks.synthetic",
}
"""Item name -> module with ``run(rep: Report, dev: torch.device, args) -> None``, in run order."""
ITEMS = tuple(REGISTRY)
HISTORY = REPO_ROOT / "benchmarks" / "results" / "history.jsonl"
"""Where each suite run appends one JSON line (see :func:`history_entry`)."""


def git_commit() -> str:
    """``DSELECTK_COMMIT`` when set (a copy of a commit's tree run elsewhere, e.g. on a GPU
    machine, where ``.git`` is not that commit's), else the checkout's commit (short hash), with
    ``+dirty`` when tracked files differ; "" if none."""
    fallback = os.environ.get("DSELECTK_COMMIT", "")
    if fallback:  # set explicitly: the tree was copied from that commit
        return fallback
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=10,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return fallback
    return head + ("+dirty" if dirty else "") if head else fallback


def history_entry(result: dict[str, Any]) -> dict[str, Any]:
    """One history line from a device's result document: facts and every row, ratio first."""
    try:
        load_end = list(os.getloadavg())
    except OSError:
        load_end = []
    items = {}
    for item, table in result["items"].items():
        items[item] = {
            "title": table.get("title", ""),
            "note": table.get("note", ""),
            "rows": table["rows"],
            "ratios": {r["case"]: r.get("ratio") for r in table["rows"]},
        }
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": git_commit(),
        "command": result["command"],
        "quick": result["quick"],
        "machine": result["machine"],
        "torch_threads": result["machine"].get("torch_threads"),
        "load_avg_end": load_end,
        "wall_s": result["wall_s"],
        "items": items,
    }


def append_history(path: Path, results: list[dict[str, Any]]) -> None:
    """Append one line per device result to the JSON-lines history at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        for result in results:
            fh.write(json.dumps(history_entry(result), default=str) + "\n")


def run_suite(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Run the selected items on ``args.device``; the result document of one device."""
    dev = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    only = set(args.only or ITEMS)
    if not args.synthetic:
        only.discard("synthetic")
    rep = Report()
    facts = machine_facts(dev)
    print("machine:", json.dumps(facts))
    t0 = time.perf_counter()
    for item, module in REGISTRY.items():
        if item in only:
            importlib.import_module(module).run(rep, dev, args)
    wall = time.perf_counter() - t0
    print(f"\nsuite wall time: {wall:.1f} s")
    return {
        "command": " ".join(["python -m benchmarks", *argv]),
        "machine": facts,
        "quick": args.quick,
        "wall_s": wall,
        "items": rep.items,
    }


def _device(text: str) -> str:
    """An argparse type: cpu, cuda, cuda:N or all (a typo is refused before any timing)."""
    name = text.strip()
    if name in ("cpu", "cuda", "all") or (name.startswith("cuda:") and name[5:].isdigit()):
        return name
    raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or all, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """The suite's command line."""
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short pass (about 2 minutes on 2 cores)")
    p.add_argument(
        "--device",
        type=_device,
        default="cpu",
        help="cpu, cuda (cuda:0, ...) or all (cpu, then cuda if present)",
    )
    p.add_argument("--only", nargs="+", choices=ITEMS, help="run only these items")
    p.add_argument(
        "--threads", type=int_at_least(0), default=0, help="torch intra-op threads (0: default)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="mmoe, train_step: also time torch.compile (minutes on 2 cores)",
    )
    p.add_argument("--synthetic", action="store_true", help="also run bench_synthetic.py")
    p.add_argument(
        "--out",
        type=out_folder,
        default=REPO_ROOT / "results" / "bench",
        help="directory of the JSON result",
    )
    p.add_argument("--record", default="", help="also write the JSON to this path")
    p.add_argument("--history", default=str(HISTORY), help="JSON-lines history this run appends to")
    p.add_argument("--no-history", action="store_true", help="do not append to the history")
    p.add_argument(
        "--no-contention", action="store_true", help="small_batch: skip the busy-process part"
    )
    p.add_argument(
        "--contention-blocks",
        type=int_at_least(1),
        default=0,
        help="small_batch: idle-then-busy blocks of the contention part (0: default 3)",
    )
    p.add_argument(
        "--small-batches",
        type=int_at_least(1),
        nargs="+",
        default=None,
        help="small_batch: batch sizes",
    )
    p.add_argument(
        "--small-reps",
        type=int_at_least(0),
        default=0,
        help="small_batch: timed rounds (0: default)",
    )
    p.add_argument(
        "--step-reps",
        type=int_at_least(0),
        default=0,
        help="train_step: timed rounds (0: default, quick 10, else 40)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point (``python -m benchmarks``): run the suite, print tables, write the JSON."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser()
    args = p.parse_args(argv)
    tune_allocator()
    if args.device == "all":
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    else:
        devices = [args.device]
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")
    results = []
    for device in devices:
        args.device = device
        results.append(run_suite(args, argv))
    result = results[0] if len(results) == 1 else {"runs": results}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dev_tag = "-".join(d.replace(":", "") for d in devices)
    path = out_dir / f"bench-{dev_tag}-{'quick-' if args.quick else ''}{stamp}.json"
    text = json.dumps(result, indent=1, default=str)
    path.write_text(text)
    print(f"results: {path}")
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(text)
        print(f"recorded: {args.record}")
    if not args.no_history:
        append_history(Path(args.history), results)
        print(f"history: {args.history}")


if __name__ == "__main__":
    main()
