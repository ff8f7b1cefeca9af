"""Report of the recovery study: ``summary.json``, ``report.md`` (template
``templates/recovery.md``) and the trajectory plots, rebuilt from the run records alone."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dselectk.experiments.records import RunStore, format_mean_se, summarize
from dselectk.experiments.recovery.model import EXPERIMENT, LABELS, NUM_TRUE, PAPER
from dselectk.experiments.templates import others_note, render
from dselectk.io import write_json, write_text

__all__ = ["print_table", "write_report"]


def _fmt(m: Mapping[str, Any] | None, digits: int = 2) -> str:
    return format_mean_se(m, digits)


def print_table(summary: Mapping[str, Any]) -> None:
    """One-screen table: per gate, the selected learning rate and the recovery counts."""
    print(
        f"{'gate':<32}{'lr':>8}  {'recovered (of 4)':>16}  {'4/4 share':>10}  "
        f"{'val acc':>12}  {'n':>4}  paper"
    )
    for row in summary["selected"]:
        m = row["metrics"]
        print(
            f"{row['label']:<32}{row['lr']:>8g}  {_fmt(m['recovered']):>16}  "
            f"{_fmt(m['all_recovered']):>10}  {_fmt(m['val_accuracy'], 3):>12}  "
            f"{m['recovered']['n']:>4}  {PAPER.get(row['gate'], '–')}"
        )


def write_report(
    results_dir: Path, *, wall_seconds: float | None = None, command: str | None = None
) -> None:
    """Rebuild ``summary.json``, ``report.md`` and the trajectory plots from the records."""
    from dselectk.plots import plot_trajectories

    results_dir = Path(results_dir)
    planned, others = RunStore(results_dir).load_planned()
    records = [r for r in planned if r["config"].get("phase") == "final"]
    prev: dict[str, Any] = {}
    if (results_dir / "summary.json").is_file():
        try:
            prev = json.loads((results_dir / "summary.json").read_text())
        except json.JSONDecodeError:
            prev = {}
    rows = summarize(records, ["gate", "lr"])
    for row in rows:
        row["label"] = LABELS.get(row["gate"], row["gate"])
        counts = [0] * (NUM_TRUE + 1)
        for r in records:
            c = r["config"]
            if c["gate"] == row["gate"] and c["lr"] == row["lr"]:
                counts[int(r["metrics"]["recovered"])] += 1
        row["recovered_histogram"] = counts
    # Tuning: the learning rate with the lowest mean validation loss, per gate.
    selected = []
    for gate in sorted({r["gate"] for r in rows}):
        cands = [r for r in rows if r["gate"] == gate]
        best = min(cands, key=lambda r: r["metrics"]["val_loss"]["mean"])
        selected.append(best)
    summary = {
        "experiment": EXPERIMENT,
        "group_by": ["gate", "lr"],
        "rows": rows,
        "selected": selected,
        "selection": "per gate, the learning rate with the lowest mean validation loss",
        "paper": PAPER,
        "records": len(records),
        "records_not_summarised": others,
        "wall_seconds": wall_seconds if wall_seconds is not None else prev.get("wall_seconds"),
        "command": command or prev.get("command"),
    }
    write_json(results_dir / "summary.json", summary)
    plots = []
    for row in selected:
        traj = next(
            (
                r.get("trajectory")
                for r in records
                if r["config"]["gate"] == row["gate"]
                and r["config"]["lr"] == row["lr"]
                and r.get("trajectory")
            ),
            None,
        )
        if traj and traj.get("steps"):
            steps = traj["steps"]
            plots.append(
                plot_trajectories(
                    steps,
                    traj["weights"],
                    results_dir / f"trajectory_{row['gate']}.png",
                    title=f"{row['label']}, lr = {row['lr']:g}, repetition 0 (true experts solid)",
                    highlight=traj.get("true"),
                    zoom_steps=max(1, steps[-1] // 10),
                )
            )
    write_text(results_dir / "report.md", _markdown(summary, plots))


def _markdown(summary: Mapping[str, Any], plots: Sequence[Path]) -> str:
    wall = summary.get("wall_seconds")
    selected_rows = []
    for r in summary["selected"]:
        m = r["metrics"]
        selected_rows.append(
            f"| {r['label']} | {r['lr']:g} | {_fmt(m['recovered'])} | "
            f"{_fmt(m['all_recovered'])} | {r['recovered_histogram']} | "
            f"{_fmt(m['val_accuracy'], 3)} | {_fmt(m['experts_selected'])} | "
            f"{str(PAPER.get(r['gate'], '–')) + '/4' if r['gate'] in PAPER else '–'} |"
        )
    all_rows = []
    for r in summary["rows"]:
        m = r["metrics"]
        all_rows.append(
            f"| {r['label']} | {r['lr']:g} | {_fmt(m['recovered'])} | {_fmt(m['all_recovered'])} "
            f"| {_fmt(m['val_loss'], 4)} | {_fmt(m['val_accuracy'], 3)} | {m['recovered']['n']} |"
        )
    claims = []
    sel = {r["gate"]: r for r in summary["selected"]}
    for gate, claim in PAPER.items():
        if gate in sel:
            got = sel[gate]["metrics"]["recovered"]["mean"]
            claims.append(
                f"- {LABELS[gate]}: paper {claim}/4 (one tuned model); ours {got:.2f}/4 on "
                f"average over {sel[gate]['metrics']['recovered']['n']} repetitions, "
                f"{100 * sel[gate]['metrics']['all_recovered']['mean']:.0f} % of repetitions "
                "recover all 4."
            )
    if "dselect_k" in sel and "topk" in sel:
        d = sel["dselect_k"]["metrics"]["recovered"]["mean"]
        k = sel["topk"]["metrics"]["recovered"]["mean"]
        verdict = "reproduces" if d > k else "does not reproduce"
        claims.append(
            f"- Qualitative claim (DSelect-k recovers more true experts than Top-k): {verdict} "
            f"({d:.2f} vs {k:.2f})."
        )
    return render(
        "recovery",
        command=summary.get("command") or "(rebuilt with dselectk report)",
        wall_line=f"Wall time: {wall:.0f} s  " if wall else "Wall time: not recorded  ",
        records=summary["records"],
        others=others_note(summary.get("records_not_summarised", 0)),
        selected_rows="\n".join(selected_rows),
        all_rows="\n".join(all_rows),
        claims="\n".join(claims),
        plots="\n".join(f"- ![{p.stem}]({p.name})" for p in plots),
    )
