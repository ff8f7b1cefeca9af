"""Compare the run records of two results folders, metric for metric.

    python scripts/compare_records.py OLD_DIR NEW_DIR [--key gate num_tasks rep ...]

A redesign must keep behaviour: records of the same run (matched by the experiment's natural
key: gate, T or learning rate, repetition, phase) must carry identical metrics. Prints one line
per differing run and a summary; exit code 1 when any metric differs or a run is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_KEY = (
    "experiment", "phase", "gate", "router", "arm", "shape", "num_tasks", "lr", "rep", "seed",
)  # fmt: skip
#: metrics that measure the machine, not the run
TIMING = (
    "train_seconds", "seconds_per_step", "examples_per_second", "load_average_at_start",
    "cpu_count", "threads",
)  # fmt: skip


def _key(cfg: dict[str, Any], fields: tuple[str, ...]) -> tuple[Any, ...]:
    hp = cfg.get("hparams", {})
    values = (cfg.get(f, hp.get(f)) for f in fields)
    return tuple(json.dumps(v, sort_keys=True) if isinstance(v, dict | list) else v for v in values)


def load(folder: Path, fields: tuple[str, ...]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The records of ``folder/runs`` by key (a repeated key is an error)."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for path in sorted((folder / "runs").glob("*.json")):
        rec = json.loads(path.read_text(encoding="utf-8"))
        key = _key(rec["config"], fields)
        if key in out:
            raise SystemExit(f"{path}: two records with the key {key}; pass a finer --key")
        out[key] = rec["metrics"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--key", nargs="+", default=list(DEFAULT_KEY), help="config fields of a run")
    p.add_argument(
        "--ignore", nargs="*", default=list(TIMING), help="metrics not compared (timings)"
    )
    args = p.parse_args(argv)
    fields = tuple(args.key)
    old, new = load(args.old, fields), load(args.new, fields)
    bad = 0
    for key in sorted(old.keys() | new.keys(), key=str):
        if key not in new or key not in old:
            print(f"only in {'old' if key in old else 'new'}: {key}")
            bad += 1
            continue
        a = {k: v for k, v in old[key].items() if k not in args.ignore}
        b = {k: v for k, v in new[key].items() if k not in args.ignore}
        if a != b:
            diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
            print(f"differs: {key}: {diff}")
            bad += 1
    print(f"{len(old)} old runs, {len(new)} new runs, {bad} differ or are missing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
