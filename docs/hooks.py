"""mkdocs hooks: the API reference pages, generated from the package, and the research files.

The API reference has one page per name of ``dselectk.__all__`` and one per public submodule
(every module or package of ``dselectk`` whose name has no leading underscore, except the
command line), so a new public name gets its page without editing the docs. The research part's
notes and committed results are served under ``research/`` so that pages can link to them.
A page's ``<!-- bench-tables key=value ... -->`` line is replaced by the benchmark tables it names,
rendered from ``benchmarks/results`` (the suite's history and records) when the site is built
(``benchmarks.readme_tables.render``), so that no page copies a timing by hand; each table
states the run's command, machine, threads, load and commit.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "dselectk"
RESEARCH = ("research/notes", "research/results", "research/README.md")
NOT_API = {"cli"}  # the command line: documented by `dselectk --help`


def public_names() -> list[str]:
    """``dselectk.__all__``, read from the source without importing torch."""
    tree = ast.parse((SRC / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [str(ast.literal_eval(e)) for e in node.value.elts]  # type: ignore[attr-defined]
    raise RuntimeError("dselectk/__init__.py defines no __all__")


def public_modules() -> list[str]:
    """Dotted names of dselectk's public submodules (and of public modules of its packages)."""
    out: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or any(p.startswith("_") for p in parts) or parts[0] in NOT_API:
            continue
        # a module inside a package is documented by its package's page unless the package
        # is only a namespace for it (dselectk.integrations.hf)
        if len(parts) > 1 and parts[0] != "integrations":
            continue
        if parts == ["integrations"]:
            continue
        out.append("dselectk." + ".".join(parts))
    return out


def _page(title: str, target: str) -> str:
    # the object's own heading (level 1) is the page's title
    return f"::: {target}\n"


def api_pages() -> dict[str, str]:
    """Path under docs/ -> Markdown of every generated API page, the index first."""
    pages: dict[str, str] = {}
    names = [n for n in public_names() if n != "__version__"]
    modules = public_modules()
    index = [
        "# API reference",
        "",
        "Generated from the docstrings. `import dselectk` gives the names below; the",
        "submodules hold the rest (training loop, search, export, schedules, ...).",
        "",
        "## Top-level names (`dselectk.__all__`)",
        "",
        "`dselectk.__version__` is the package's version string.",
        "",
    ]
    for name in names:
        target = f"dselectk.{name}"
        pages[f"api/{name}.md"] = _page(f"`dselectk.{name}`", target)
        index.append(f"- [`{name}`]({name}.md)")
    index += ["", "## Submodules", ""]
    for mod in modules:
        short = mod.removeprefix("dselectk.")
        if short in names:  # already a page (dselectk.functional)
            index.append(f"- [`{mod}`]({short}.md)")
            continue
        pages[f"api/{short}.md"] = _page(f"`{mod}`", mod)
        index.append(f"- [`{mod}`]({short}.md)")
    return {"api/index.md": "\n".join(index) + "\n", **pages}


def on_files(files: Files, config: Any) -> Files:
    for path, content in api_pages().items():
        files.append(File.generated(config, path, content=content))
    for item in RESEARCH:
        base = ROOT / item
        for f in [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()):
            rel = f.relative_to(ROOT).as_posix()
            files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def _research_link(page_src: str, match: re.Match[str]) -> str:
    """A research page's link as the site can serve it.

    The notes and reports link to folders (shown on GitHub as listings) and to plots that are not
    committed. On the site a folder link goes to the folder's ``report.md`` or ``README.md``; a
    link whose target does not exist becomes plain text.
    """
    bang, text, target = match.groups()
    if "://" in target or target.startswith(("#", "mailto:")):
        return match.group(0)
    path, _, anchor = target.partition("#")
    resolved = ((ROOT / page_src).parent / path).resolve()
    docs = ROOT / "docs"
    if resolved.is_file() and resolved.is_relative_to(docs):  # a page of this site
        rel = os.path.relpath(resolved.relative_to(docs), Path(page_src).parent)
        return f"{bang}[{text}]({Path(rel).as_posix()}{f'#{anchor}' if anchor else ''})"
    if resolved.is_dir():
        for name in ("report.md", "README.md"):
            if (resolved / name).is_file():
                new = path.rstrip("/") + "/" + name + (f"#{anchor}" if anchor else "")
                return f"{bang}[{text}]({new})"
        return text if text.startswith("`") else f"`{text}`"
    if not resolved.exists() or not resolved.is_relative_to(ROOT / "research"):
        return text if text.startswith("`") else f"`{text}`"
    return match.group(0)


_BENCH = re.compile(r"^<!-- bench-tables((?:\s+[\w-]+=\S+)*)\s*-->$", re.MULTILINE)


def _recorded_at(path: Path) -> str:
    """The short hash of the last commit that changed ``path`` ("" outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%h", "--", str(path)],
            capture_output=True, text=True, cwd=ROOT, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def bench_tables(markdown: str, page: str) -> str:
    """``markdown`` with each ``<!-- bench-tables ... -->`` line replaced by its tables."""
    if "<!-- bench-tables" not in markdown:
        return markdown
    if str(ROOT) not in sys.path:  # benchmarks/ is a top-level folder of the checkout
        sys.path.insert(0, str(ROOT))
    tables = importlib.import_module("benchmarks.readme_tables")

    def one(m: re.Match[str]) -> str:
        options = dict(kv.split("=", 1) for kv in m.group(1).split())
        try:
            return str(tables.render(options, ROOT, _recorded_at))
        except (ValueError, OSError) as err:
            raise PluginError(f"{page}: {m.group(0)}: {err}") from err

    return _BENCH.sub(one, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    src = page.file.src_uri
    if not src.startswith("research/"):
        return bench_tables(markdown, src)
    return _LINK.sub(lambda m: _research_link(src, m), markdown)


# Sphinx roles in docstrings (":class:`~dselectk.x.Name`") shown as code: the short name with "~"
_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):<code>(~?)([^<]+)</code>")


def _role(m: re.Match[str]) -> str:
    name = m.group(2).split(".")[-1] if m.group(1) else m.group(2)
    return f"<code>{name}</code>"


def on_post_page(output: str, page: Any, config: Any) -> str:
    return _ROLE.sub(_role, output)
