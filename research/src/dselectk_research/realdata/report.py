"""The real-data reports, rebuilt from the records alone (:func:`write_report`): the final
records of the latest sweep command summarised into ``summary.json``, the recipe's paper
tables, Table C.2 (:func:`table_c2`), the gate heatmaps and trajectories, all rendered through
the ``realdata`` report template."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from dselectk.io import write_json, write_text
from dselectk_research.monitor import flops_ratio
from dselectk_research.realdata.spec import FINITE, VARIANTS, Experiment, cell_key, label
from dselectk_research.records import (
    RunStore,
    diverged,
    produced_by,
    read_object,
    summarize,
)
from dselectk_research.templates import diverged_rows, environment_line, format_mean_se, render

#: the paragraph of a notes template after which the quick-mode notes start
QUICK_MARK = "<!-- quick mode -->"


def reference_path(results_dir: Path, data_cfg: Mapping[str, Any]) -> Path:
    """``reference_<hash of the data config>.json``: the cached reference predictors."""
    key = hashlib.sha1(json.dumps(dict(data_cfg), sort_keys=True).encode()).hexdigest()[:12]
    return Path(results_dir) / f"reference_{key}.json"


def cached_reference(
    results_dir: Path, data_cfg: Mapping[str, Any], compute: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """``compute()``, once per data configuration (cached with the config inside)."""
    path = reference_path(results_dir, data_cfg)
    cached = read_object(path)
    if "reference" in cached and cached.get("data") == json.loads(json.dumps(dict(data_cfg))):
        return dict(cached["reference"])
    ref = compute()
    write_json(path, {"data": dict(data_cfg), "reference": ref})
    return ref


def paper_numbers(name: str) -> dict[str, Any]:
    """The paper's numbers for recipe ``name`` (``experiments/realdata_paper.json``; keys
    starting with ``_`` are comments)."""
    text = resources.files("dselectk_research").joinpath("realdata_paper.json").read_text()

    def drop_comments(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if not k.startswith("_")}

    return json.loads(text, object_hook=drop_comments)[name]


#: a column of a paper table: (our metric, its scale, its digits, index of the paper's value
#: in its row, the paper value's format, whether the paper's standard error follows it)
Column = tuple[str, float, int, int, str, bool]


def gate_rows(
    rows: Mapping[tuple[Any, str], Mapping[str, Any]],
    setting: Any,
    columns: Sequence[Column],
    paper: Mapping[str, Sequence[Any]],
) -> list[str]:
    """Markdown rows of a paper table, one per gate run at ``setting`` (report order): its
    label, then per column ours (``mean ± se``) and the paper's (``-`` when absent)."""
    out = []
    for gate in VARIANTS:
        if (setting, gate) not in rows:
            continue
        m, p = rows[(setting, gate)]["metrics"], paper.get(gate)
        cells = [diverged_label(rows[(setting, gate)])]
        for metric, scale, digits, i, pfmt, se in columns:
            cells.append(fmt(m.get(metric), scale, digits))
            if p is None or p[i] is None:
                cells.append("-")
            else:
                cells.append(f"{p[i]:{pfmt}}" + (f" ± {p[i + 1]:{pfmt}}" if se else ""))
        out.append("| " + " | ".join(cells) + " |")
    return out


def diverged_label(row: Mapping[str, Any]) -> str:
    """A row's gate label, with ``(**d of n runs diverged**)`` when some of its runs did."""
    text = label(str(row.get("gate")))
    if row.get("diverged"):
        text += f" (**{row['diverged']} of {row.get('runs', '?')} runs diverged**)"
    return text


def diverged_cells(summary: Mapping[str, Any]) -> list[str]:
    """``gate[/key=setting] (d of n)`` of every summary row with diverged runs."""
    key = (summary.get("group_by") or ["gate"])[0]
    setting_key = None if key == "gate" else key
    return diverged_rows(summary, lambda r: cell_key(setting_key, r["gate"], r.get(key)))


def template_notes(name: str, *, quick: bool, **values: Any) -> list[str]:
    """The "Setup and choices" notes of template ``templates/<name>.md``: one per paragraph,
    ``<!-- ... -->`` paragraphs left out, those after ``<!-- quick mode -->`` only when
    ``quick``."""
    setup, _, rest = render(name, **values).partition(QUICK_MARK)

    def paragraphs(text: str) -> list[str]:
        parts = (p.strip() for p in text.split("\n\n"))
        return [p for p in parts if p and not p.startswith("<!--")]

    return paragraphs(setup) + (paragraphs(rest) if quick else [])


def fmt(m: Mapping[str, Any] | None, scale: float = 1.0, digits: int = 2) -> str:
    """``mean ± se`` of a summarised metric (``-`` when missing)."""
    return format_mean_se(m, digits, scale=scale, missing="-", show_n=True)


def current_records(
    records: Sequence[Mapping[str, Any]],
    setting_key: str | None,
    data_cfg: Mapping[str, Any] | None,
    selected: Mapping[str, Any],
    training: Mapping[str, Any] | None = None,
) -> list[Mapping[str, Any]]:
    """The records of the latest sweep command of a results folder: those with the data of
    ``run_info.json``, the ``--init`` and ``--optimizer-defaults`` of its ``training`` and the
    hyperparameters of ``selected_hparams.json`` (each when present), so that a table row never
    mixes configurations; the others stay on disk (reused when their flags run again)."""
    out = []
    for r in records:
        c = r["config"]
        if data_cfg is not None and c.get("data") != dict(data_cfg):
            continue
        if training and any(c.get(k) != v for k, v in training.items()):
            continue
        sel = selected.get(cell_key(setting_key, c["gate"], c.get(setting_key or "")))
        if sel is not None and dict(sorted(sel["hparams"].items())) != c.get("hparams"):
            continue
        out.append(r)
    return out


#: records by (setting, gate) cell, as the summary rows are keyed
Cells = Mapping[tuple[Any, str], Sequence[Mapping[str, Any]]]


def table_c2(
    spec: Experiment,
    rows: Mapping[tuple[Any, str], Mapping[str, Any]],
    cells: Cells,
    settings: Sequence[Any],
) -> tuple[list[str], dict[str, Any]]:
    """Markdown rows and values of Table C.2 (ours beside the paper's; the header is the
    ``realdata`` template's)."""
    lines: list[str] = []
    values: dict[str, Any] = {}
    for setting, kind in ((s, k) for s in settings for k in ("static", "per_example")):
        col = spec.c2_column.format(setting)
        dk, tk = f"dselect_k_{kind}", f"topk_{kind}"
        if (setting, dk) not in rows:
            continue
        m, recs = rows[(setting, dk)]["metrics"], cells.get((setting, dk), [])
        reached = sum(1 for r in recs if r["metrics"].get("binary_reached"))
        ratio = math.nan
        if (setting, tk) in rows:
            fb = [r["metrics"].get("train_expert_flops") for r in cells.get((setting, tk), [])]
            ratio = flops_ratio([r["metrics"].get("train_expert_flops") for r in recs], fb)
        values[f"{col}/{kind}"] = {
            "pct_steps_until_binary": m.get("pct_steps_until_binary"),
            "runs_binary": reached,
            "runs": len(recs),
            "flops_ratio": ratio,
        }
        paper = spec.paper_c2.get(col, {}) if kind == "static" else {}
        per_task = []
        for t in range(1, len(spec.task_names) + 1):
            with_key = [r for r in recs if f"binary_reached_task{t}" in r["metrics"]]
            rt = sum(1 for r in with_key if r["metrics"][f"binary_reached_task{t}"])
            pct = fmt(m.get(f"pct_steps_until_binary_task{t}"))
            per_task.append(f"T{t}: {pct} ({rt}/{len(with_key)})")
        if rows[(setting, dk)].get("diverged"):
            col += f" (**{rows[(setting, dk)]['diverged']} of {len(recs)} runs diverged**)"
        lines.append(
            f"| {col} | {kind.replace('_', '-')} | {fmt(m.get('pct_steps_until_binary'))} | "
            f"{reached}/{len(recs)} | {'; '.join(per_task)} | {_num(paper.get('pct'))} | "
            f"{_num(ratio, '.2f')} | {_num(paper.get('flops'))} |"
        )
    return lines, values


def _num(v: float | None, spec: str = "g") -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:{spec}}"


def _plots(
    spec: Experiment, rows: Iterable[tuple[Any, str]], cells: Cells, out: Path
) -> list[Path]:
    """Heatmap and trajectory of repetition 0 (the lowest) of each (setting, gate) row."""
    from dselectk_research.plots import optional_plot
    from dselectk_research.plots.realdata import plot_task_heatmap, plot_task_trajectories

    heatmap, trajectories = optional_plot(plot_task_heatmap), optional_plot(plot_task_trajectories)
    plots: list[Path | None] = []
    key, names = spec.setting_key, spec.task_names
    for setting, gate in sorted(rows, key=lambda k: (str(k[0]), k[1])):
        recs = sorted(cells.get((setting, gate), []), key=lambda r: r["config"]["rep"])
        if not recs:
            continue
        rec, traj = recs[0], recs[0].get("trajectory")
        tag = gate if key is None else f"{gate}_{key}{setting}"
        name = label(gate) + ("" if key is None else f", {key} = {setting}")
        if rec.get("gate_weights"):
            title = f"{spec.title}: expert weights, {name} (rep {rec['config']['rep']})"
            path = out / "plots" / f"heatmap_{tag}.png"
            plots.append(heatmap(rec["gate_weights"], path, title=title, task_names=names))
        if traj and traj.get("steps"):
            title = f"{spec.title}: gate weights during training, {name}"
            path = out / "plots" / f"trajectory_{tag}.png"
            plots.append(
                trajectories(traj["steps"], traj["weights"], path, title=title, task_names=names)
            )
    return [p for p in plots if p is not None]  # None: matplotlib is not installed


def write_report(results_dir: Path, spec: Experiment) -> None:
    """Rebuild ``summary.json``, ``report.md`` and the plots of ``spec`` from the run records
    (and the cached reference predictors of the data of ``run_info.json``)."""
    results_dir = Path(results_dir)
    all_records, others = RunStore(results_dir).load_planned()
    info = read_object(results_dir / "run_info.json")
    selected = read_object(results_dir / "selected_hparams.json")
    mine = [r for r in all_records if r["config"].get("experiment") == spec.name]
    finals = [r for r in mine if r["config"].get("phase") == "final"]
    records = current_records(
        finals, spec.setting_key, info.get("data"), selected, info.get("training")
    )
    tunes = [r for r in all_records if r["config"].get("phase") == "tune"]
    group = ["gate"] if spec.setting_key is None else [spec.setting_key, "gate"]
    summary_rows = summarize(records, group, finite=FINITE)
    rows = {(row.get(spec.setting_key or ""), row["gate"]): row for row in summary_rows}
    settings = sorted({k[0] for k in rows}, key=lambda v: (v is None, v))
    cells: dict[tuple[Any, str], list[Mapping[str, Any]]] = {}
    for r in records:
        c = r["config"]
        cells.setdefault((c.get(spec.setting_key or ""), c["gate"]), []).append(r)
    c2_lines, c2_values = table_c2(spec, rows, cells, settings)
    plots = _plots(spec, rows, cells, results_dir)
    summary = {
        "experiment": spec.name,
        "group_by": group,
        "rows": summary_rows,
        "table_c2": c2_values,
        "records": len(records),
        "diverged": sum(int(r.get("diverged", 0)) for r in summary_rows),
        "tune_records": len(tunes),
        "tune_diverged": sum(1 for r in tunes if diverged(r, FINITE)),
        "run_info": info,
        "produced_by": produced_by(records),
        "plots": [str(p.relative_to(results_dir)) for p in plots],
    }
    write_json(results_dir / "summary.json", summary)
    data_cfg = info.get("data")
    reference = None
    if isinstance(data_cfg, dict):
        reference = read_object(reference_path(results_dir, data_cfg)).get("reference")
    text = render(
        "realdata",
        title=spec.title,
        run_info="".join(f"{line}\n" for line in _run_lines(info, records)),
        records=len(records),
        diverged=_diverged_sentence(summary),
        tune_records=len(tunes),
        stale=len(finals) - len(records) + others,
        tables="\n".join(spec.tables(rows, settings, reference)),
        table_c2="".join(f"\n{line}" for line in c2_lines),  # rows under the template's header
        plots="\n".join(f"- [{p.name}]({p.relative_to(results_dir)})" for p in plots),
    )
    write_text(results_dir / "report.md", text.rstrip("\n") + "\n")


def _diverged_sentence(summary: Mapping[str, Any]) -> str:
    """The report's sentence on diverged runs (final and tuning)."""
    n, tune = int(summary.get("diverged") or 0), int(summary.get("tune_diverged") or 0)
    text = " None diverged."
    if n:
        text = (
            f" **{n} of them diverged** (non-finite or exploded losses: "
            f"{', '.join(diverged_cells(summary))});"
            " the tables name them beside their gate and leave them out of the means."
        )
    if tune:
        text += f" **{tune} tuning runs diverged** (their grid points were never selected)."
    return text


def _run_lines(info: Mapping[str, Any], records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's lines on the command (``run_info.json``) and its setup notes."""
    if not info:
        return []
    train_s = sum(float(r["metrics"].get("train_seconds", 0.0)) for r in records)
    lines = [
        f"Command: `{info.get('command')}`  ",
        f"Mode: **{info.get('mode')}**, repetitions per gate and setting: "
        f"{info.get('repetitions')}, cumulative wall time of the sweep commands: "
        f"{float(info.get('wall_seconds') or 0):.0f} s; training time of the summarised "
        f"runs: {train_s:.0f} s.  ",
        environment_line(produced_by(records)) + ".",
        "",
    ]
    if info.get("mode") == "quick":
        lines += [render("realdata_quick").strip(), ""]
    if info.get("notes"):
        lines += ["## Setup and choices", ""] + [f"- {n}" for n in info["notes"]] + [""]
    return lines
