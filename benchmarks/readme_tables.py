"""Print the README's speed tables (Markdown) from the last line of the benchmark history.

``python -m benchmarks.readme_tables [--history PATH] [--entry -1]``: one table per item of that
suite run (``python -m benchmarks``), each with the run's machine, threads, load average and
commit, so the README's numbers come from one command instead of being typed by hand. The GPU
section: ``--history benchmarks/results/gpu/history.jsonl --marker benchmarks-gpu --gpu-gate
benchmarks/results/gpu/gpu_gate.json`` (the latter: ``python -m benchmarks.gpu_gate``'s JSON).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.suite import HISTORY

__all__ = ["load_entry", "main", "tables"]


def load_entry(path: Path, index: int = -1) -> dict[str, Any]:
    """The ``index``-th JSON line of the history at ``path`` (default: the last)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        raise SystemExit(f"{path} holds no benchmark run yet: run python -m benchmarks first")
    return dict(json.loads(lines[index]))


def _ms(v: Any) -> str:
    return f"{v:.3g} ms" if isinstance(v, (int, float)) else "–"


def _ratio(v: Any) -> str:
    return f"{v:.2f}×" if isinstance(v, (int, float)) else "–"


def _small_batch(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| batch, threads | DSelect-k | Top-k | Top-k / DSelect-k | DSelect-k, step on 1 thread |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.get('B')}, {r.get('threads')} | {_ms(r['ours_ms'])} | {_ms(r.get('base_ms'))} "
            f"| {_ratio(r.get('ratio'))} | {_ms(r.get('ours_1t_ms'))} |"
        )
    return out


def _contention(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| gate | batch | idle | beside busy processes | busy / idle | blocks' range |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratios = r.get("ratios") or []
        span = f"{min(ratios):.2f}–{max(ratios):.2f} ({len(ratios)})" if ratios else "–"
        out.append(
            f"| {r.get('gate')} | {r.get('B')} | {_ms(r.get('base_ms'))} | {_ms(r['ours_ms'])} "
            f"| {_ratio(r.get('ratio'))} | {span} |"
        )
    return out


def _generic(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| case | ours | baseline | baseline / ours | config |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['case']} | {_ms(r.get('ours_ms'))} | {_ms(r.get('base_ms'))} "
            f"| {_ratio(r.get('ratio'))} | {r.get('config', '')} |"
        )
    return out


def _steps(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) else "–"


def _train_step(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| model, threads | case | ours steps/s | baseline steps/s | ours / baseline | load |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        case = r["case"].split(": ", 1)[-1]
        load = f"{r.get('load_avg_1m', '?')} → {r.get('load_avg_1m_after', '?')}"
        out.append(
            f"| {r.get('model')}, {r.get('threads')} | {case} "
            f"| {_steps(r.get('ours_steps_per_s'))} | {_steps(r.get('base_steps_per_s'))} "
            f"| {_ratio(r.get('ratio'))} | {load} |"
        )
    return out


def tables(entry: dict[str, Any]) -> str:
    """The Markdown of one history entry: a facts line, then one table per item."""
    m = entry.get("machine", {})
    load = m.get("load_avg_1m", "?")
    load = f"{load:.2f}" if isinstance(load, (int, float)) else load
    gpu = f"{m['gpu']} GPU, " if m.get("gpu") else ""
    facts = (
        f"_{entry.get('command', 'python -m benchmarks')}_ on {gpu}{m.get('cpu', '?')} "
        f"({m.get('cpu_count', '?')} cores), {m.get('torch_threads', '?')} torch threads, "
        f"load average {load} at the start, torch {m.get('torch', '?')}, "
        f"commit {entry.get('commit') or '?'}, {entry.get('time', '')}"
    )
    parts = [facts, ""]
    for item, table in entry.get("items", {}).items():
        rows = table.get("rows", [])
        parts.append(f"**{item}**: {table.get('title', '')}")
        if table.get("note"):
            parts.append(f"({table['note']})")
        parts.append("")
        formats = {
            "small_batch": _small_batch,
            "contention": _contention,
            "train_step": _train_step,
        }
        fmt = formats.get(item, _generic)
        parts.extend(fmt(rows))
        parts.append("")
    return "\n".join(parts)


def gpu_gate_table(doc: dict[str, Any]) -> str:
    """The Markdown of ``python -m benchmarks.gpu_gate``'s JSON: ms, Top-k / this and the device
    kernels of one forward + backward, per batch size and formulation."""
    m = doc.get("machine", {})
    out = [
        f"_python -m benchmarks.gpu_gate_ on {m.get('gpu', '?')}, torch {m.get('torch', '?')}, "
        f"commit {doc.get('commit') or '?'}",
        "",
        "| batch | gate | fwd + bwd | Top-k / this | kernels launched |",
        "|---|---|---|---|---|",
    ]
    for r in doc.get("rows", []):
        out.append(
            f"| {r['B']} | {r['gate']} | {_ms(r['median_ms'])} | {_ratio(r['topk_over_this'])} "
            f"| {r['kernels']} |"
        )
    return "\n".join(out) + "\n"


BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"


def replace_block(text: str, block: str, marker: str = "benchmarks") -> str:
    """``text`` with the part between the README's two ``marker`` lines replaced by ``block``."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"the README has no {begin} ... {end} block")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{block}\n{end}{tail}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme_tables", description=__doc__)
    p.add_argument("--history", default=str(HISTORY), help="the suite's JSON-lines history")
    p.add_argument("--entry", type=int, default=-1, help="which line (default: the last)")
    p.add_argument(
        "--readme", default=None, help="write the tables into this file between its markers"
    )
    p.add_argument("--marker", default="benchmarks", help="the README block's marker name")
    p.add_argument("--gpu-gate", default=None, help="also this benchmarks.gpu_gate JSON's table")
    args = p.parse_args(argv)
    block = tables(load_entry(Path(args.history), args.entry))
    if args.gpu_gate:
        block += "\n**gpu_gate**\n\n" + gpu_gate_table(json.loads(Path(args.gpu_gate).read_text()))
    if args.readme is None:
        print(block)
        return
    path = Path(args.readme)
    text = path.read_text(encoding="utf-8")
    path.write_text(replace_block(text, block, args.marker), encoding="utf-8")
    print(f"wrote the tables of {args.history} into {path}")


if __name__ == "__main__":
    main()
