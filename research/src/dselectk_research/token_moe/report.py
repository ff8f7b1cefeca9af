"""Report of the token-MoE study: ``summary.json`` and ``report.md`` (template
``templates/token_moe.md``), rebuilt from the run records alone. The records keep validation
bits per byte under the key ``val_bpc``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dselectk.io import write_json, write_text
from dselectk_research.records import (
    EXPLOSION_FACTOR,
    RunStore,
    diverged,
    mean_se,
    sweep_summary,
)
from dselectk_research.templates import (
    Column,
    header,
    markdown_table,
    render,
    screen_table,
)
from dselectk_research.token_moe.model import EXPERIMENT, ROUTERS


def _label(router: str) -> str:
    return ROUTERS[router].label if router in ROUTERS else router


#: metrics a run must have finite and at most their bound, else it counts as diverged: a
#: validation loss over :data:`~dselectk_research.records.EXPLOSION_FACTOR` times the 8 bits per
#: byte of the uniform prediction
FINITE = {"val_bpc": EXPLOSION_FACTOR * 8.0}
#: the results table (router); those with a ``screen`` heading are also printed
COLUMNS = (
    Column("router", value=lambda r: r["label"]),
    Column("val bits/byte", "val_bpc", 4),
    Column("final train loss", "train_loss", 3, screen=None),
    Column("max load / mean load (worst layer)", "load_max_over_mean", 2, screen="max load/mean"),
    Column(
        "distinct experts per token (dispatched)",
        "dispatched_experts_per_token",
        3,
        screen="experts/token",
    ),
    Column("experts per token (nonzero weights)", "experts_per_token", 2, screen=None),
    Column("load coefficient of variation (worst layer)", "load_cv", 2, screen=None),
    Column("tokens with binary bits", "binary_token_fraction", 3, screen="binary tokens"),
    Column("training tokens / s", "tokens_per_second", 0, screen="tokens/s"),
    Column("seeds", value=lambda r: r["metrics"]["val_bpc"]["n"]),
    Column("diverged", value=lambda r: r["diverged"]),
)


def print_table(summary: Mapping[str, Any]) -> None:
    """One-screen table: per router, validation bits per byte and routing figures (the runner
    names the diverged runs after it)."""
    print(*screen_table(COLUMNS, summary["rows"]), sep="\n")


def write_report(
    results_dir: Path,
    *,
    wall_seconds: float | None = None,
    command: str | None = None,
    jobs: int | None = None,
    threads: int | None = None,
) -> None:
    """Rebuild ``summary.json`` and ``report.md`` from the records."""
    results_dir = Path(results_dir)
    planned, others = RunStore(results_dir).load_planned()  # this command's runs only
    records = [r for r in planned if r["config"].get("experiment") == EXPERIMENT]
    ok = [r for r in records if not diverged(r, FINITE)]
    for r in ok:  # derived scalars for the summary
        m, hp = r["metrics"], r["config"]["hparams"]
        m["ms_per_step"] = 1000 * m["seconds_per_step"]
        m["tokens_per_second"] = hp["batch_size"] * hp["seq_len"] / m["seconds_per_step"]
        frac = torch.tensor(m["load"], dtype=torch.float64)  # (layer, expert) fractions
        m["load_cv"] = float((frac.std(-1, correction=0) / frac.mean(-1)).max())
    given = {"jobs": jobs, "threads": threads}  # (None: the last summary's)
    summary = sweep_summary(
        results_dir, EXPERIMENT, ["router"], records, others, FINITE, wall_seconds, command, **given
    )
    for row in summary["rows"]:
        row["label"] = _label(row["router"])
        loads = [r["metrics"]["load"] for r in ok if r["config"]["router"] == row["router"]]
        row["load"] = (  # (layer, expert)
            torch.tensor(loads, dtype=torch.float64).mean(0).tolist() if loads else []
        )
    first = records[0] if records else {}
    summary |= {
        "per_seed": sorted(
            (r["config"]["seed"], r["config"]["router"], r["metrics"]["val_bpc"]) for r in ok
        ),
        "diverged_runs": sorted(
            (r["config"]["seed"], r["config"]["router"], r["metrics"].get("diverged_at_step"))
            for r in records
            if diverged(r, FINITE)
        ),
        "hparams": first.get("config", {}).get("hparams"),
        "val_windows": sorted({r["metrics"].get("val_windows") or 0 for r in ok}),
        "corpus": first.get("config", {}).get("corpus"),
        "environment": first.get("environment"),
        "machine": {
            "cpu_count": first.get("metrics", {}).get("cpu_count"),
            "load_average": sorted(
                round(float(r["metrics"].get("load_average_at_start", float("nan"))), 1)
                for r in records
            ),
        },
    }
    write_json(results_dir / "summary.json", summary)
    write_text(results_dir / "report.md", _markdown(summary))


def diverged_line(summary: Mapping[str, Any]) -> str | None:
    """The one line naming the runs that diverged, or None."""
    runs = summary.get("diverged_runs") or []
    if not runs:
        return None
    named = ", ".join(f"{_label(g)} seed {s} (step {step})" for s, g, step in runs)
    return (
        f"{len(runs)} run(s) diverged (non-finite or exploded loss or gradients): {named}; "
        "counted in the report, left out of its means; lower --lr"
    )


def _verdict(rows: list[dict[str, Any]], per_seed: list[list[Any]]) -> str:
    """Every router against Top-k: means, and the paired difference by seed when 2+ seeds."""
    by = {r["router"]: r["metrics"]["val_bpc"] for r in rows if r["metrics"]["val_bpc"]["n"]}
    if "topk" not in by or len(by) < 2:
        return (
            "No Top-k baseline beside another router (with runs that did not diverge): "
            "no comparison."
        )
    vals: dict[tuple[str, int], float] = {(g, s): v for s, g, v in per_seed}
    lines = []
    for router in (r for r in by if r != "topk"):
        d, t = by[router]["mean"], by["topk"]["mean"]
        seeds = sorted({s for g, s in vals if g == router and ("topk", s) in vals})
        diffs = [vals[(router, s)] - vals[("topk", s)] for s in seeds]
        text = f"- {_label(router)}: {d:.4f} against Top-k's {t:.4f}"
        if len(diffs) >= 2:
            mean, se = (mean_se(diffs)[key] for key in ("mean", "se"))
            wins = sum(x < 0 for x in diffs)
            within = (
                "within"
                if abs(mean) <= se
                else ("better by more than" if mean < 0 else "worse by more than")
            )
            text += (
                f"; paired by seed, {mean:+.4f} ± {se:.4f} (standard error, {len(diffs)} seeds; "
                f"lower on {wins} of {len(diffs)}): {within} one standard error"
            )
        lines.append(text + ".")
    return "Validation bits per byte (lower is better):\n\n" + "\n".join(lines)


def _capacity(summary: Mapping[str, Any]) -> str:
    """The report's words for the capacity limit (``--capacity-factor``), with the pairs each
    router had dropped on the validation tokens."""
    c = (summary.get("hparams") or {}).get("capacity_factor")
    if c is None:
        return "no capacity limit"
    dropped = [
        f"{r['label']} {d['mean']:.3f}"
        for r in summary["rows"]
        if (d := r["metrics"].get("dropped_pairs_per_token")) and d.get("mean") is not None
    ]
    return (
        f"capacity factor {c:g}: each expert takes at most ⌈{c:g}·N·k/n⌉ of the (token, expert) "
        "pairs of a batch of N tokens, first choices first, in training and validation, and "
        "drops the rest; pairs dropped per validation token and layer: "
        + ("; ".join(dropped) or "(not recorded)")
    )


def _markdown(summary: Mapping[str, Any]) -> str:
    loads = [
        f"| {r['label']} | {layer} | " + " ".join(f"{v:.3f}" for v in fr) + " |"
        for r in summary["rows"]
        for layer, fr in enumerate(r["load"])
    ]
    seeds = [f"| {s} | {_label(g)} | {v:.4f} |" for s, g, v in summary["per_seed"]]
    env = summary.get("environment") or {}
    m0 = summary.get("machine") or {}
    return render(
        "token_moe",
        **header(summary),
        jobs=summary.get("jobs") or "?",
        threads=summary.get("threads") or "?",
        machine=(
            f"{m0.get('cpu_count', '?')} CPUs, load average at the runs' starts "
            f"{m0.get('load_average', '?')}, torch {env.get('torch', '?')}"
        ),
        diverged=f" **{line}.**" if (line := diverged_line(summary)) else "",
        capacity=_capacity(summary),
        hparams=json.dumps(summary.get("hparams") or {}, sort_keys=True),
        val_windows=" or ".join(str(n) for n in summary.get("val_windows") or [] if n)
        or "(not recorded)",
        corpus=json.dumps(summary.get("corpus") or {}, sort_keys=True),
        results="\n".join(markdown_table(COLUMNS, summary["rows"])),
        loads="\n".join(loads),
        seeds="\n".join(seeds),
        verdict=_verdict(summary["rows"], summary["per_seed"]),
    )
