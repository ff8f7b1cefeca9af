"""No dangling references in what users read: git tags (they do not travel with a clone; cite
commits), paths outside the repository (``../shared``), and, in the user-facing text, no talk of
sessions, issue numbers or section marks of our notes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".md", ".py", ".toml", ".cff", ".yml", ".txt", ".sh", ".cfg"}
# the tags the history once named; none exists
KNOWN_MISSING = ("pre-remedy-deletion", "pre-token-remedy-deletion", "distinct-binary-screen")
# "tag `name`", "git tag name", "tag **`name`**"; a TensorBoard tag (``<gate>/<metric>``) is not
# a git name, so names hold only git-ref characters and no "/"
TAG = re.compile(
    r"\b(?:git\s+)?tags?\s+\**`{1,2}([A-Za-z0-9][\w.-]*)`{1,2}|\bgit\s+tag\s+([\w.-]+)"
)


def _files(*parts: str) -> list[Path]:
    out: list[Path] = []
    for part in parts:
        p = ROOT / part
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += [f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in TEXT_SUFFIXES
                    and "__pycache__" not in f.parts]  # fmt: skip
    return out


SCANNED = _files(
    "README.md",
    "CHANGELOG.md",
    "CITATION.cff",
    "pyproject.toml",
    "mkdocs.yml",
    "Makefile",
    "docs",
    "src",
    "research",
    "examples",
    "tests",
    "benchmarks",
    "scripts",
)
USER_FACING = _files("README.md", "CHANGELOG.md", "docs", "src", "examples")


def _existing_tags() -> set[str]:
    out = subprocess.run(["git", "tag"], cwd=ROOT, capture_output=True, text=True)
    return set(out.stdout.split()) if out.returncode == 0 else set()


def _hits(pattern: re.Pattern[str], files: list[Path]) -> list[str]:
    hits = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    return hits


def test_the_scan_sees_the_tree() -> None:
    names = {f.relative_to(ROOT).as_posix() for f in SCANNED}
    assert {"README.md", "CHANGELOG.md", "src/dselectk/__init__.py"} <= names
    assert any(n.startswith("research/notes/") for n in names)


def test_no_missing_git_tags() -> None:
    this_file = Path(__file__).resolve()
    files = [f for f in SCANNED if f.resolve() != this_file]
    known = re.compile("|".join(re.escape(t) for t in KNOWN_MISSING))
    assert _hits(known, files) == []
    tags = _existing_tags()
    dangling = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        for m in TAG.finditer(text):
            name = m.group(1) or m.group(2)
            if name not in tags:
                line = text.count("\n", 0, m.start()) + 1
                dangling.append(f"{f.relative_to(ROOT)}:{line}: tag {name!r}")
    assert dangling == [], "cite a commit hash instead of a tag:\n" + "\n".join(dangling)


def test_tag_pattern() -> None:
    assert TAG.search("at the git tag `pre-x`").group(1) == "pre-x"  # type: ignore[union-attr]
    assert TAG.search("tag **`v1.0`**").group(1) == "v1.0"  # type: ignore[union-attr]
    assert TAG.search("git tag v2").group(2) == "v2"  # type: ignore[union-attr]
    assert TAG.search("one scalar per tag ``<gate name>/<metric>``") is None


def test_no_paths_outside_the_repository() -> None:
    this_file = Path(__file__).resolve()
    files = [f for f in SCANNED if f.resolve() != this_file]
    assert _hits(re.compile(r"\.\./shared\b"), files) == []


def test_user_facing_text_does_not_speak_of_our_process() -> None:
    pattern = re.compile(r"\b[Ss]essions? \d|\b[Ii]ssues? \d|\b[Ii]ssue-\d|§")
    assert _hits(pattern, USER_FACING) == []


def test_readme_links_resolve() -> None:
    """Every relative link of the README (read on the repository's page) names a file here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(links) >= 10
    missing = [t for t in links if "://" not in t and not (ROOT / t.split("#")[0]).exists()]
    assert missing == []
