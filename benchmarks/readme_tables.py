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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "entry_with",
    "item_table",
    "latest_document",
    "load_entry",
    "main",
    "synthetic_table",
    "tables",
]

HISTORY = Path(__file__).resolve().parent / "results" / "history.jsonl"
"""The suite's history (``benchmarks.suite.HISTORY``; this module imports no torch, so that the
documentation's build can render the tables)."""


def _normalise(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with the small_batch item's contention table under its present name
    (``small_batch_contention``; older runs called it ``contention``, rows keyed by ``gate``)."""
    items = entry.get("items", {})
    old = items.get("contention")
    if old and old.get("rows") and "gate" in old["rows"][0]:
        items = {
            ("small_batch_contention" if k == "contention" else k): v for k, v in items.items()
        }
        entry = {**entry, "items": items}
    return entry


def load_entry(path: Path, index: int = -1) -> dict[str, Any]:
    """The ``index``-th JSON line of the history at ``path`` (default: the last)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        raise SystemExit(f"{path} holds no benchmark run yet: run python -m benchmarks first")
    return _normalise(dict(json.loads(lines[index])))


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


def _blocks_range(r: dict[str, Any]) -> str:
    """A contention row's range of busy / idle over its blocks, and their number."""
    ratios = r.get("ratios") or []
    return f"{min(ratios):.2f}–{max(ratios):.2f} ({len(ratios)})" if ratios else "–"


def _contention(rows: list[dict[str, Any]]) -> list[str]:
    if rows and "way" in rows[0]:  # the contention item: 2 threads vs the thread policy
        out = [
            "| step | threads | idle | beside busy processes | busy / idle | blocks' range |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            step = r["case"].removesuffix(" " + str(r["way"]))
            out.append(
                f"| {step} | {r['way']} | {_ms(r.get('base_ms'))} | {_ms(r['ours_ms'])} "
                f"| {_ratio(r.get('ratio'))} | {_blocks_range(r)} |"
            )
        return out
    out = [
        "| gate | batch | idle | beside busy processes | busy / idle | blocks' range |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.get('gate')} | {r.get('B')} | {_ms(r.get('base_ms'))} | {_ms(r['ours_ms'])} "
            f"| {_ratio(r.get('ratio'))} | {_blocks_range(r)} |"
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


def _mb(v: Any) -> str:
    return f"{v:.3g} MB" if isinstance(v, (int, float)) else "–"


def _memory(rows: list[dict[str, Any]]) -> list[str]:
    """The memory item: its ``ours_ms`` / ``base_ms`` fields hold megabytes, not times."""
    out = ["| case | ours | baseline | baseline / ours | config |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['case']} | {_mb(r.get('ours_ms'))} | {_mb(r.get('base_ms'))} "
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


_FORMATS = {
    "small_batch": _small_batch,
    "contention": _contention,
    "small_batch_contention": _contention,
    "train_step": _train_step,
    "memory": _memory,
}


def facts(entry: dict[str, Any]) -> str:
    """One line of a run's provenance: command, machine, threads, load, torch, commit, time."""
    m = entry.get("machine", {})
    load = m.get("load_avg_1m", "?")
    load = f"{load:.2f}" if isinstance(load, (int, float)) else load
    gpu = f"{m['gpu']} GPU, " if m.get("gpu") else ""
    end = entry.get("load_avg_end") or []
    end_s = f" ({end[0]:.2f} at the end)" if end and isinstance(end[0], (int, float)) else ""
    return (
        f"_{entry.get('command', 'python -m benchmarks')}_ on {gpu}{m.get('cpu', '?')} "
        f"({m.get('cpu_count', '?')} cores), {m.get('torch_threads', '?')} torch threads, "
        f"load average {load} at the start{end_s}, torch {m.get('torch', '?')}, "
        f"commit {entry.get('commit') or '?'}, {entry.get('time', '')}"
    )


def item_table(entry: dict[str, Any], item: str, heading: bool = True) -> str:
    """The Markdown table of ``item`` in ``entry`` (a history line or a result document)."""
    table = entry["items"][item]
    parts = []
    if heading:
        parts.append(f"**{item}**: {table.get('title', '')}")
        if table.get("note"):
            parts.append(f"({table['note']})")
        parts.append("")
    parts.extend(_FORMATS.get(item, _generic)(table.get("rows", [])))
    return "\n".join(parts) + "\n"


def tables(entry: dict[str, Any]) -> str:
    """The Markdown of one history entry: a facts line, then one table per item."""
    parts = [facts(entry), ""]
    for item in entry.get("items", {}):
        parts.append(item_table(entry, item))
    return "\n".join(parts)


def _newest_first(path: Path) -> Iterator[dict[str, Any]]:
    """The runs of the history at ``path``, newest first (normalised, see :func:`_normalise`)."""
    for line in reversed(path.read_text(encoding="utf-8").splitlines()):
        if line.strip():
            yield _normalise(json.loads(line))


def entry_with(path: Path, item: str, skip: int = 0) -> dict[str, Any]:
    """The newest line of the history at ``path`` that holds ``item`` (``skip``: that many
    such lines newer than it are passed over). A LookupError when there is none."""
    seen = 0
    for entry in _newest_first(path):
        if item in entry.get("items", {}):
            if seen == skip:
                return dict(entry)
            seen += 1
    raise LookupError(f"{path} holds no run of the benchmark item {item!r}")


def latest_document(path: Path, commit: str = "") -> dict[str, Any]:
    """A result document (``--record PATH``) as a history entry: its ``commit`` is the given
    one (the commit that recorded the file) when the document has none."""
    doc = dict(json.loads(path.read_text()))
    if not doc.get("commit"):
        doc["commit"] = commit
    return doc


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


def _runs(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The runs of a ``bench_synthetic --json`` record: the document itself when it is one run,
    else its values that are runs (a record collecting several, by name)."""
    if "fused_s" in doc:
        return {"run": doc}
    return {k: v for k, v in doc.items() if isinstance(v, dict) and "fused_s" in v}


def _seconds(v: Any) -> str:
    return f"{v:.3g} s" if isinstance(v, (int, float)) else "–"


def _hours(v: Any) -> str:
    return f"{v / 3600:.2f} h" if isinstance(v, (int, float)) else "–"


def synthetic_table(doc: dict[str, Any], commit: str = "") -> str:
    """The Markdown of a ``python -m benchmarks.bench_synthetic --json`` record (one run, or runs
    by name): per run, the fused loss against the autograd loss and the batched model against
    one repetition at a time (wall time of the same steps, baseline / ours), and the estimate of
    the Appendix C.1 protocol's final phase; for two runs that differ only in ``jobs`` (same
    threads, same epochs), the estimate with more processes against the one with fewer.

    Raises:
        ValueError: the document holds no run.
    """
    runs = _runs(doc)
    if not runs:
        raise ValueError("bench-tables: the record holds no bench_synthetic run (no fused_s)")
    out = [
        f"_{doc.get('command', 'python -m benchmarks.bench_synthetic')}_, commit {commit or '?'}"
    ]
    if doc.get("note"):
        out.append(f"({doc['note']})")
    out += [
        "",
        "| run | threads, processes | case | ours | baseline | baseline / ours |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        tp = f"{r.get('threads', '?')}, {r.get('jobs', '?')}"
        out.append(
            f"| {name} | {tp} | fused loss vs autograd loss | {_seconds(r.get('fused_s'))} "
            f"| {_seconds(r.get('composed_s'))} | {_ratio(r.get('fused_ratio'))} |"
        )
        out.append(
            f"| {name} | {tp} | batched vs one at a time | {_seconds(r.get('batched_s'))} "
            f"| {_seconds(r.get('sequential_s'))} | {_ratio(r.get('ratio'))} |"
        )
        out.append(
            f"| {name} | {tp} | C.1 final phase, estimate (epochs: {r.get('epochs_from', '?')}) "
            f"| {_hours(r.get('full_estimate_s'))} | – | – |"
        )
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ra, rb = runs[a], runs[b]
            same = all(ra.get(k) == rb.get(k) for k in ("threads", "epochs_from"))
            if not same or ra.get("jobs") == rb.get("jobs"):
                continue
            more, fewer = (a, b) if (ra.get("jobs") or 0) > (rb.get("jobs") or 0) else (b, a)
            est_m, est_f = runs[more].get("full_estimate_s"), runs[fewer].get("full_estimate_s")
            numbers = all(isinstance(v, (int, float)) for v in (est_m, est_f))
            ratio = est_f / est_m if numbers and est_m else None
            out.append(
                f"| {more} vs {fewer} | {runs[more].get('threads', '?')}, "
                f"{runs[more].get('jobs', '?')} vs {runs[fewer].get('jobs', '?')} "
                f"| C.1 final phase, estimate: {runs[more].get('jobs')} processes vs "
                f"{runs[fewer].get('jobs')} | {_hours(est_m)} | {_hours(est_f)} | {_ratio(ratio)} |"
            )
    return "\n".join(out) + "\n"


def _entry_at(path: Path, commit: str, items: str) -> dict[str, Any]:
    """The newest line of the history at ``path`` measured at a commit starting with ``commit``
    that holds every item of the comma-separated ``items`` (any line when empty)."""
    if len(commit) < 7:
        raise ValueError(f"bench-tables: commit= needs at least 7 hex digits, got {commit!r}")
    wanted = [n for n in items.split(",") if n]
    try:
        for entry in _newest_first(path):
            if str(entry.get("commit", "")).startswith(commit) and all(
                n in entry.get("items", {}) for n in wanted
            ):
                return entry
    except OSError as err:
        raise ValueError(f"bench-tables: cannot read {path}: {err}") from err
    held = f" holding {wanted}" if wanted else ""
    raise ValueError(f"bench-tables: no run at commit {commit}{held} in {path}")


def render(options: dict[str, str], root: Path, commit_of: Any = None) -> str:
    """The Markdown a documentation page's ``<!-- bench-tables key=value ... -->`` line stands
    for (``docs/hooks.py`` renders them when the site is built), paths relative to ``root``:

    - ``item=NAME``: the newest run of the history holding item NAME: its facts line and table;
    - ``history=PATH`` (default ``benchmarks/results/history.jsonl``) with ``entry=N`` (the
      N-th line, negative from the end): that run's facts line and all its tables (``items=a,b``:
      only those); or with ``commit=PREFIX`` instead of ``entry``: the newest line measured at
      the commit starting with PREFIX (of those holding ``items``, when given), so that a page
      keeps showing that run when newer runs are appended;
    - ``record=PATH``: a result document written by ``--record`` (its commit is
      ``commit_of(PATH)``, the commit that recorded the file, when it holds none);
    - ``gpu-gate=PATH``: also ``python -m benchmarks.gpu_gate``'s table;
    - ``synthetic=PATH``, alone: a ``python -m benchmarks.bench_synthetic --json`` record's table
      (:func:`synthetic_table`; its commit is ``commit_of(PATH)``).

    Raises:
        ValueError: an unknown key, a missing file, or an item no run holds.
    """
    known = {"item", "history", "entry", "commit", "items", "record", "gpu-gate", "synthetic"}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"bench-tables: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    if "synthetic" in options:
        if len(options) > 1:
            others = sorted(set(options) - {"synthetic"})
            raise ValueError(f"bench-tables: synthetic= stands alone, got also {others}")
        path = root / options["synthetic"]
        try:
            doc = json.loads(path.read_text())
        except OSError as err:
            raise ValueError(f"bench-tables: cannot read {path}: {err}") from err
        return synthetic_table(dict(doc), commit_of(path) if commit_of else "")
    history = root / options.get("history", "benchmarks/results/history.jsonl")
    if "record" in options:
        path = root / options["record"]
        entry = latest_document(path, commit_of(path) if commit_of else "")
    elif "item" in options:
        try:
            entry = entry_with(history, options["item"])
        except (LookupError, OSError) as err:
            raise ValueError(f"bench-tables: {err}") from err
        return f"{facts(entry)}\n\n{item_table(entry, options['item'])}"
    elif "commit" in options:
        if "entry" in options:
            raise ValueError("bench-tables: give entry= or commit=, not both")
        entry = _entry_at(history, options["commit"], options.get("items", ""))
    else:
        try:
            entry = load_entry(history, int(options.get("entry", "-1")))
        except (IndexError, OSError, SystemExit) as err:
            raise ValueError(f"bench-tables: no entry {options.get('entry')} in {history}") from err
    names = options["items"].split(",") if "items" in options else list(entry.get("items", {}))
    missing = [n for n in names if n not in entry.get("items", {})]
    if missing:
        raise ValueError(f"bench-tables: the run holds no item {missing}")
    parts = [facts(entry), ""] + [item_table(entry, n) for n in names]
    if "gpu-gate" in options:
        doc = json.loads((root / options["gpu-gate"]).read_text())
        parts += ["**gpu_gate**", "", gpu_gate_table(doc)]
    return "\n".join(parts)


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
