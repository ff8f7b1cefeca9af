"""Report of the recovery study: ``summary.json``, ``report.md`` (template
``templates/recovery.md``) and the trajectory plots, rebuilt from the run records alone."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dselectk.io import write_json, write_text
from dselectk_research.best import RULE, best_configuration
from dselectk_research.data.recovery import NUM_TRUE
from dselectk_research.records import (
    EXPLOSION_FACTOR,
    RunStore,
    diverged,
    read_object,
    sweep_summary,
)
from dselectk_research.recovery.model import EXPERIMENT, NUM_EXPERTS, VARIANTS
from dselectk_research.templates import (
    Column,
    diverged_rows,
    header,
    markdown_table,
    render,
    screen_table,
)

#: true experts recovered by the paper's tuned model, at the paper's shape
PAPER = {"dselect_k": 4, "topk": 1}
PAPER_SHAPE = {"experts": NUM_EXPERTS, "true": NUM_TRUE, "k": NUM_TRUE}
#: metrics a run must have finite and at most their bound, else it counts as diverged: a
#: validation loss (binary cross-entropy) over :data:`~dselectk_research.records.EXPLOSION_FACTOR`
#: times ln 2, the loss of predicting 1/2
FINITE = {"val_loss": EXPLOSION_FACTOR * math.log(2.0)}


def diverged_lrs(summary: Mapping[str, Any]) -> list[str]:
    """``gate lr=X (d of n)`` of every (gate, learning rate) with diverged runs."""
    return diverged_rows(summary, lambda r: f"{r['gate']} lr={r['lr']:g}")


def diverged_line(summary: Mapping[str, Any]) -> str | None:
    """The runner's line naming the learning rates whose runs diverged, or None."""
    bad = diverged_lrs(summary)
    if not bad:
        return None
    return (
        f"runs diverged (non-finite or exploded validation loss) at {', '.join(bad)}; the report "
        "counts them and the selection skips those learning rates; lower --lrs"
    )


def _skipped_text(summary: Mapping[str, Any]) -> str:
    """One line on the learning rates the selection skipped (diverged runs), or ''."""
    skipped = summary.get("skipped_lrs") or {}
    parts = [f"{g}: {', '.join(f'{lr:g}' for lr in lrs)}" for g, lrs in sorted(skipped.items())]
    text = ""
    if parts:
        text = f"Learning rates skipped by the selection (runs diverged): {'; '.join(parts)}."
    if none := summary.get("no_selection"):
        text += f" No learning rate without diverged runs for {', '.join(none)}: not selected."
    return text.strip()


def _shape_text(shape: Mapping[str, int]) -> str:
    return f"{shape['experts']} experts, {shape['true']} true, k = {shape['k']}"


def _columns(summary: Mapping[str, Any], selected: bool) -> list[Column]:
    """The columns of the table of the selected learning rates, or (not ``selected``) of all."""
    n, paper = summary["shape"]["true"], PAPER if summary["shape"] == PAPER_SHAPE else {}
    head = [
        Column("gate", value=lambda r: r["label"]),
        Column("lr", value=lambda r: f"{r['lr']:g}"),
        Column(f"recovered of {n}", "recovered"),
    ]
    if not selected:
        return [
            *head,
            Column(f"all {n}", "all_recovered"),
            Column("val loss", "val_loss", 4),
            Column("val accuracy", "val_accuracy", 3),
            Column("n", value=lambda r: (r["metrics"].get("recovered") or {}).get("n", 0)),
            Column("diverged", value=lambda r: r.get("diverged", 0)),
        ]
    return [
        *head,
        Column(f"all {n} recovered", "all_recovered", screen=f"all {n}"),
        Column(f"histogram 0..{n}", value=lambda r: r["recovered_histogram"], screen="histogram"),
        Column("val accuracy", "val_accuracy", 3, screen="val acc"),
        Column("experts selected", "experts_selected", screen="selected"),
        Column(
            "paper", value=lambda r: f"{paper[r['gate']]}/{NUM_TRUE}" if r["gate"] in paper else "–"
        ),
    ]


def print_table(summary: Mapping[str, Any]) -> None:
    """Per variant, the selected learning rate and the recovery counts (the report's table;
    the runner names the diverged runs after it)."""
    print(f"shape: {_shape_text(summary['shape'])}")
    print(*screen_table(_columns(summary, True), summary["selected"]), sep="\n")
    if skipped := _skipped_text(summary):
        print(skipped)


def write_report(
    results_dir: Path, *, wall_seconds: float | None = None, command: str | None = None
) -> None:
    """Rebuild ``summary.json``, ``report.md`` and the trajectory plots from the records."""
    from dselectk_research.plots import optional_plot, plot_trajectories

    trajectories = optional_plot(plot_trajectories)  # draws nothing on the core install
    results_dir = Path(results_dir)
    planned, others = RunStore(results_dir).load_planned()
    records = [r for r in planned if r["config"].get("phase") == "final"]
    summary = sweep_summary(
        results_dir, EXPERIMENT, ["gate", "lr"], records, others, FINITE, wall_seconds, command
    )
    shape = records[0]["config"].get("shape", PAPER_SHAPE) if records else PAPER_SHAPE
    rows = summary["rows"]
    by_key = {(row["gate"], row["lr"]): row for row in rows}
    for row in rows:
        row["label"] = VARIANTS[row["gate"]].label if row["gate"] in VARIANTS else row["gate"]
        row["recovered_histogram"] = [0] * (shape["true"] + 1)
    trajs: dict[tuple[str, float], Any] = {}
    for r in records:
        key = (r["config"]["gate"], r["config"]["lr"])
        if not diverged(r, FINITE):
            by_key[key]["recovered_histogram"][int(r["metrics"]["recovered"])] += 1
        if r.get("trajectory"):
            trajs.setdefault(key, r["trajectory"])
    # Tuning, per variant: the shared rule (dselectk_research.best) over its learning rates in
    # the table's order, each with its repetitions' validation losses; a learning rate with a
    # diverged run is skipped (its mean would be over the survivors only)
    losses: dict[tuple[str, float], list[float]] = {}
    for r in records:
        loss = math.nan if diverged(r, FINITE) else r["metrics"]["val_loss"]
        losses.setdefault((r["config"]["gate"], r["config"]["lr"]), []).append(loss)
    selected, skipped, no_selection = [], {}, []
    for g in sorted({r["gate"] for r in rows}):
        mine = [r for r in rows if r["gate"] == g]
        choice = best_configuration((r["lr"], losses[(g, r["lr"])]) for r in mine)
        if choice.diverged:
            skipped[g] = sorted(choice.diverged)
        if choice.key is None:
            no_selection.append(g)
        else:
            selected.append(next(r for r in mine if r["lr"] == choice.key))
    summary |= {
        "shape": shape,
        "hparams_source": _hparams_source(results_dir),
        "selected": selected,
        "selection": f"per gate, over its learning rates: {RULE}",
        "skipped_lrs": skipped,
        "no_selection": no_selection,
        "paper": PAPER,
    }
    write_json(results_dir / "summary.json", summary)
    plots = []
    for row in selected:
        traj = trajs.get((row["gate"], row["lr"]))
        if traj and traj.get("steps"):
            plots.append(
                trajectories(
                    traj["steps"],
                    traj["weights"],
                    results_dir / f"trajectory_{row['gate']}.png",
                    title=f"{row['label']}, lr = {row['lr']:g}, repetition 0 (true experts solid)",
                    highlight=traj.get("true"),
                    zoom_steps=max(1, traj["steps"][-1] // 10),
                )
            )
    drawn = [p for p in plots if p is not None]  # None: matplotlib is not installed
    write_text(results_dir / "report.md", _markdown(summary, drawn))


def _hparams_source(results_dir: Path) -> str:
    """Where the variants' hyperparameters came from (``selected_hparams.json``'s sources: the
    shipped file, or a ``--tuned`` file named with its content digest)."""
    sel = read_object(results_dir / "selected_hparams.json")
    sources = {str(v["source"]) for v in sel.values() if isinstance(v, dict) and v.get("source")}
    named = sorted(f"`{s}`" if s == "tuned_recovery.json" else s for s in sources)
    return "; ".join(named) or "the shipped `tuned_recovery.json`"


def _markdown(summary: Mapping[str, Any], plots: list[Path]) -> str:
    shape, sel = summary["shape"], {r["gate"]: r["metrics"] for r in summary["selected"]}
    claims = [
        f"- {VARIANTS[gate].label}: paper {claim}/4 (one tuned model); ours "
        f"{sel[gate]['recovered']['mean']:.2f}/4 on average over {sel[gate]['recovered']['n']} "
        f"repetitions, {100 * sel[gate]['all_recovered']['mean']:.0f} % of repetitions recover "
        "all 4."
        for gate, claim in PAPER.items()
        if gate in sel and shape == PAPER_SHAPE
    ]
    if shape != PAPER_SHAPE:
        claims.append(f"- The paper's counts are for {_shape_text(PAPER_SHAPE)}: not compared.")
    if "dselect_k" in sel and "topk" in sel:
        d, k = sel["dselect_k"]["recovered"]["mean"], sel["topk"]["recovered"]["mean"]
        claims.append(
            "- Qualitative claim (DSelect-k recovers more true experts than Top-k): "
            f"{'reproduces' if d > k else 'does not reproduce'} ({d:.2f} vs {k:.2f})."
        )
    return render(
        "recovery",
        **header(summary),
        diverged=(
            f" **{summary['diverged']} of them diverged** (non-finite or exploded validation loss: "
            f'{", ".join(diverged_lrs(summary))}); counted in the "diverged" column, left '
            "out of the means."
            if summary.get("diverged")
            else " None diverged."
        ),
        skipped=_skipped_text(summary),
        shape=_shape_text(shape),
        experts=shape["experts"],
        true=shape["true"],
        random=shape["experts"] - shape["true"],
        k=shape["k"],
        tuned_source=summary["hparams_source"],
        selected_table="\n".join(markdown_table(_columns(summary, True), summary["selected"])),
        all_table="\n".join(markdown_table(_columns(summary, False), summary["rows"])),
        claims="\n".join(claims),
        plots="\n".join(f"- ![{p.stem}]({p.name})" for p in plots),
    )
