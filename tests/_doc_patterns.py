"""Patterns shared by the documentation tests (test_docs_performance, test_docs_provenance)."""

from __future__ import annotations

import re

# A page's ``<!-- bench-tables key=value ... -->`` line, replaced at build time by tables that
# state their runs' provenance.
BENCH_TABLES = re.compile(r"^<!-- bench-tables((?:\s+[\w-]+=\S+)*)\s*-->$", re.MULTILINE)

# 7 to 40 hex digits with at least one digit and one letter a-f: a (short) commit hash, not a
# word ("deface", "added") or a number ("1000000").
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
