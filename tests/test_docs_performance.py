"""The Performance page copies no measurement by hand.

Every timing and ratio on ``docs/performance.md`` comes from a table rendered from
``benchmarks/results/`` when the site is built (its ``<!-- bench-tables ... -->`` lines), and
each table states its run's command, machine, threads, load and commit. Typed-in numbers go
stale as soon as the code or the machine changes; these tests keep them out of the page's own
text and check that every table line of it renders.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from _doc_patterns import BENCH_TABLES, COMMIT_HASH

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "performance.md"
MARKER = BENCH_TABLES

# What a measurement typed into prose looks like. Sizes and constants of the API (2¹⁸, B = 4096,
# 16 ulps) match none of these.
MEASURED = {
    "commit hash": COMMIT_HASH,
    "time": re.compile(r"\d(?:[\d.,]*\d)?\s?(?:ms|µs|us|ns|s|sec|min|minutes|h|hours)\b"),
    "ratio": re.compile(r"\d(?:[\d.,]*\d)?\s?(?:×|x\b)"),
    "percentage": re.compile(r"\d\s?%"),
    "decimal": re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])"),
    "date or clock time": re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}:\d{2}\b"),
    "load": re.compile(r"\bload(?: average)? (?:of )?\d"),
}
# Exact phrases allowed although a pattern above matches them (constants, not measurements).
ALLOWED: tuple[str, ...] = ()


def prose(text: str) -> str:
    """``text`` without its bench-tables lines (what the page itself says)."""
    text = MARKER.sub("", text)
    for phrase in ALLOWED:
        text = text.replace(phrase, "")
    return text


def measured_quantities(text: str) -> list[tuple[str, str]]:
    """(kind, match) of every measurement-like quantity in ``text``'s prose."""
    body = prose(text)
    return [(kind, m.group(0)) for kind, pat in MEASURED.items() for m in pat.finditer(body)]


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ("Three runs in a row (commit 7049fb1, 2026-11-27 19:17)", "commit hash"),
        ("Three runs in a row (commit 7049fb1, 2026-11-27 19:17)", "date or clock time"),
        ("the Top-k gate's speed: 0.34–0.71× for B = 256", "ratio"),
        ("the Top-k gate's speed: 0.34–0.71 for B = 256", "decimal"),
        ("compiles for about 31 s (float64 28 s more)", "time"),
        ("B = 4096 on one thread: 5.03, 3.97 and 4.62 ms", "time"),
        ("ours reaches 74–83 % of it", "percentage"),
        ("| same, 10 repetitions batched vs one at a time | | | 5.1x |", "ratio"),
        ("faster at B ≤ 256 (load 5–6)", "load"),
        ("takes 3446 s (57 min) measured on 2 cores", "time"),
    ],
)
def test_the_detector_finds_typed_in_measurements(line: str, kind: str) -> None:
    assert kind in {k for k, _ in measured_quantities(line)}


@pytest.mark.parametrize(
    "line",
    [
        "up to `kernels.dispatch.HOST_GATE_MAX_ELEMENTS` (2¹⁸) selector entries",
        "a step of less than `runtime.PARALLEL_MIN_WORK` (batch × trainable parameters, 2²⁸)",
        "at B = 1, 16, 256 and 4096 (p = 64, n = 128, k = 4, float32)",
        "within four times its error plus 16 ulps; 8 Dense-256 experts, towers 256 → 1",
        "4 gates × 4 task counts × 100 repetitions; `--threads 1`; `gpu_tests-COMMIT.log`",
        "<!-- bench-tables item=moe -->",
    ],
)
def test_the_detector_passes_sizes_and_constants(line: str) -> None:
    assert measured_quantities(line) == []


def test_performance_page_types_in_no_measurement() -> None:
    found = measured_quantities(PAGE.read_text(encoding="utf-8"))
    assert not found, (
        f"docs/performance.md states measurements by hand: {found}. Put the number in a result "
        "file under benchmarks/results/ and render it with a <!-- bench-tables ... --> line."
    )


def test_every_bench_tables_line_of_the_page_renders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    tables = importlib.import_module("benchmarks.readme_tables")
    lines = list(MARKER.finditer(PAGE.read_text(encoding="utf-8")))
    assert len(lines) >= 10  # every item of the page has its table
    for m in lines:
        options = dict(kv.split("=", 1) for kv in m.group(1).split())
        md = tables.render(options, ROOT, lambda path: "recorded")
        assert "\n|---|" in md and re.search(r"\| \d+\.\d\d× \|", md), m.group(
            0
        )  # a table of ratios
        assert "commit " in md, m.group(0)  # and where it came from
