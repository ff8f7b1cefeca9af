"""Run ``dselectk demo`` over a range of seeds and count what it observed.

``python scripts/demo_seeds.py FIRST LAST [--jobs 2] [--json PATH] [-- DEMO FLAGS...]`` runs
``dselectk demo --seed s --no-progress`` for s = FIRST ... LAST (one process per seed, ``--jobs``
at a time) and prints, per seed, every restart's validation MSE and identical-set pairs, which
restart the demo kept, and its two yes/no lines; then how many seeds answered "yes". The demo's
design is chosen on development seeds and reported on others (README): this script is how both
were counted.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

RESTART = re.compile(r"^restart (\d+): validation MSE ([0-9.]+); (\d+) of (\d+) same-group", re.M)


def run_seed(seed: int, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "dselectk.cli", "demo", "--seed", str(seed), "--no-progress"]
    res = subprocess.run([*cmd, *extra], capture_output=True, text=True, check=False)
    out = res.stdout
    if res.returncode != 0:
        raise SystemExit(f"seed {seed}: demo failed ({res.returncode}): {res.stderr[-500:]}")
    restarts = [
        {"restart": int(r), "val_mse": float(v), "identical": int(i), "pairs": int(p)}
        for r, v, i, p in RESTART.findall(out)
    ]
    kept = re.search(r"^restart (\d+):.*<- kept$", out, re.M)
    return {
        "seed": seed,
        "restarts": restarts,
        "kept": int(kept.group(1)) if kept else 0,
        "same": "selected the same experts: yes" in out,
        "share": "the two tasks share an expert: yes" in out,
        "seconds": float(m.group(1)) if (m := re.search(r" in ([0-9.]+)s on one", out)) else None,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first", type=int)
    p.add_argument("last", type=int)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the per-seed results here")
    args = p.parse_args(argv)
    seeds = list(range(args.first, args.last + 1))
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(lambda s: run_seed(s, extra), seeds))
    for r in rows:
        rs = ", ".join(f"{x['val_mse']:.4f}/{x['identical']}" for x in r["restarts"]) or "-"
        print(
            f"seed {r['seed']}: kept restart {r['kept']}; same experts in every group: "
            f"{'yes' if r['same'] else 'no'}; share: {'yes' if r['share'] else 'no'}; "
            f"restarts (validation MSE/identical pairs): {rs}; {r['seconds']} s"
        )
    n = len(rows)
    print(
        f"seeds {args.first}-{args.last}: the same experts in every group in "
        f"{sum(r['same'] for r in rows)} of {n}; an expert shared in every group in "
        f"{sum(r['share'] for r in rows)} of {n}"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"extra": extra, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
