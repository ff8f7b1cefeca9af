"""The documentation pages speak to users; provenance lives in the reports they link.

A page of ``docs/`` says what the package does and what the studies found, and links the
report or result folder that holds each number (``research/results/*/report.md``, the research
notes, ``benchmarks/results/``). Where and when a number was measured (the commit, the date and
clock time, the machine's load) belongs in those reports, which record it for every run: on a
page it goes stale with the next commit and tells a reader nothing they can act on. These tests
keep commit hashes, dates, clock times and load figures out of every page but the changelog.
Results themselves (MSE, accuracy, ± intervals, seeds) are the pages' content and are allowed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _doc_patterns import BENCH_TABLES, COMMIT_HASH

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXCLUDED = {DOCS / "changelog.md"}

PROVENANCE = {
    "commit hash": COMMIT_HASH,
    "date": re.compile(r"\b\d{4}-\d{2}-\d{2}\b"),
    "clock time": re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\s*(?:UTC|GMT|[ap]\.?m\.?)?(?!\d)"),
    "UTC": re.compile(r"\bUTC\b"),
    # a load figure ("load 1.4", "load average 2.8–3.8", "load of 2"); "the load average" as a
    # concept (what the thread policy does not use) is not provenance
    "load figure": re.compile(
        r"\bload(?:\s+average)?(?:\s+(?:of|about|was|at))?\s*(?:~|≈)?\s*\d", re.IGNORECASE
    ),
}


def pages() -> list[Path]:
    """Every page of the site but the changelog: docs/*.md and docs/howto/*.md."""
    found = sorted(DOCS.glob("*.md")) + sorted((DOCS / "howto").glob("*.md"))
    return [p for p in found if p not in EXCLUDED]


def provenance(text: str) -> list[tuple[str, str]]:
    """(kind, match) of every commit hash, date, clock time or load figure in ``text``."""
    body = BENCH_TABLES.sub("", text)
    return [(kind, m.group(0)) for kind, pat in PROVENANCE.items() for m in pat.finditer(body)]


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ("on a fresh clone of fa2e01f: 1,523 s", "commit hash"),
        ("equal to the records of 248535b", "commit hash"),
        ("their commands run at commit `539b307`", "commit hash"),
        ("its last run (2026-11-27 23:07–23:12 UTC, commit 7857c64)", "date"),
        ("its last run (2026-11-27 23:07–23:12 UTC, commit 7857c64)", "clock time"),
        ("150 s measured at 11:28 UTC", "clock time"),
        ("150 s measured at 11:28 UTC", "UTC"),
        ("180 s (load 1.4–1.9)", "load figure"),
        ("beside other work (load average 2.8–3.8)", "load figure"),
        ("on the 2-core CPU (load about 2; small commands beside it)", "load figure"),
        ("load average of 0.45 at the start", "load figure"),
    ],
)
def test_the_detector_finds_provenance(line: str, kind: str) -> None:
    assert kind in {k for k, _ in provenance(line)}


@pytest.mark.parametrize(
    "line",
    [
        "+0.0006 ± 0.0070 bits per byte from Top-k over all 27 seeds (3000–3008, 4000–4017)",
        "test MSE 0.0382 ± 0.0007, related Jaccard 0.716 ± 0.004; 1,600,334 examples",
        "the decade was added, deface the cafe; a feed of 1000000 bytes; 2¹⁸ entries",
        "about 25 minutes on 2 cores; 1 h 54 min tuning; lr 1e-2, ε = 1e-7",
        "The load average is deliberately not used to size the pool: it lags by a minute",
        "each table states the run's command, machine, threads, load average and commit",
        "a more even load (max/mean 1.32 against 1.57); load per expert",
        "<!-- bench-tables item=gate commit=35739ad -->",
        "a 36×36 canvas; win/tie/loss 2/20/2; ratio 1:4",
    ],
)
def test_the_detector_passes_results_and_words(line: str) -> None:
    assert provenance(line) == []


def test_the_pages_are_found() -> None:
    names = {p.relative_to(DOCS).as_posix() for p in pages()}
    assert {"results.md", "reproducing.md", "development.md", "howto/index.md"} <= names
    assert "changelog.md" not in names


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_no_page_states_provenance(page: Path) -> None:
    found = provenance(page.read_text(encoding="utf-8"))
    assert not found, (
        f"{page.relative_to(ROOT)} states where or when something was measured: {found}. "
        "Say what was found in plain words and link the report or result folder that records "
        "the commit, date and load (research/results/, research/notes/, benchmarks/results/)."
    )


def test_readme_states_no_provenance() -> None:
    found = provenance((ROOT / "README.md").read_text(encoding="utf-8"))
    assert not found, f"README.md states where or when something was measured: {found}"
