"""The package's architecture, read from the source with ``ast`` (nothing is imported).

Imports go one way, down this stack (a group may import itself and the groups its rule lists):

    base         _testing, functional, io, progress, runtime
    kernels      dselectk.kernels       (DSelect-k's kernels: ATen, NumPy, numba, Triton; dispatch)
    gates        dselectk.gates
    layers       dselectk.layers        (expert banks, CNN experts/towers, expert mixer)
    models       dselectk.models        (MoE, multi-gate MoE, shared bottom)
    training     optim, schedules, training (the package: loop, config, tasks, guards,
                 checkpoint, callbacks, state, search), export, telemetry, search, variants
    api          dselectk/__init__.py   (the public facade: re-exports base..training)
    data         dselectk_research.data          (loaders; no models, training or experiments)
    plots        dselectk_research.plots         (a leaf: draws arrays/records, imports only base)
    integrations dselectk.integrations  (adapters to other libraries: gates and layers only)
    experiments  dselectk_research   (anything except cli)
    cli          dselectk.cli           (anything)

The direction rules check every import anywhere in a module (module level, inside functions,
under ``if TYPE_CHECKING:``) plus ``importlib.import_module`` calls whose target is readable
from the source. The cycle check uses every import that runs: module level and inside functions
(a function-level import is the usual way to hide a cycle), plus ``importlib.import_module``
calls anywhere; only ``if TYPE_CHECKING:`` blocks, which never run, are left out. An f-string
target with a literal package prefix (``f"dselectk_research.{name}"``) counts as an import of
every module under that prefix.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "dselectk"
RESEARCH_SRC = ROOT / "research" / "src"
RESEARCH_PKG = RESEARCH_SRC / "dselectk_research"

#: group -> the groups it may import (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    "base": frozenset(),
    "kernels": frozenset({"base"}),
    "gates": frozenset({"base", "kernels"}),
    "layers": frozenset({"base", "kernels", "gates"}),
    "models": frozenset({"base", "kernels", "gates", "layers"}),
    "training": frozenset({"base", "kernels", "gates", "layers", "models"}),
    "api": frozenset({"base", "kernels", "gates", "layers", "models", "training"}),
    "integrations": frozenset({"base", "kernels", "gates", "layers"}),
    "cli": frozenset(
        {"base", "kernels", "gates", "layers", "models", "api", "training", "integrations"}
    ),
    "research": frozenset(
        {"base", "kernels", "gates", "layers", "models", "api", "training", "integrations", "cli"}
    ),
}

#: top-level name under dselectk -> group.
GROUP_OF_TOP: dict[str, str] = {
    "_testing": "base",
    "functional": "base",
    "io": "base",
    "progress": "base",
    "runtime": "base",
    "kernels": "kernels",
    "gates": "gates",
    "layers": "layers",
    "models": "models",
    "optim": "training",
    "schedules": "training",
    "training": "training",
    "export": "training",
    "telemetry": "training",
    "search": "training",
    "variants": "training",
    "members": "training",
    "integrations": "integrations",
    "cli": "cli",
    "demo": "cli",
    "_argtypes": "base",
    "_validate": "base",
}

# --------------------------------------------------------------------------------------------
# reading the source
# --------------------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    root = RESEARCH_SRC if path.is_relative_to(RESEARCH_SRC) else SRC
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


_FILES = sorted(PKG.rglob("*.py")) + sorted(RESEARCH_PKG.rglob("*.py"))
MODULES: dict[str, Path] = {_module_name(p): p for p in _FILES}
PACKAGES = {_module_name(p) for p in _FILES if p.name == "__init__.py"}


def _group(module: str) -> str:
    if module.split(".")[0] == "dselectk_research":
        return "research"
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    try:
        return GROUP_OF_TOP[parts[1]]
    except KeyError:
        raise AssertionError(
            f"{module}: new top-level module; give it a group in GROUP_OF_TOP"
        ) from None


def _resolve(target: str) -> str | None:
    """The module an import of ``target`` loads (the longest prefix that is a module)."""
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in MODULES:
            return name
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _static_targets(node: ast.Import | ast.ImportFrom, module: str) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        package = module if module in PACKAGES else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    for alias in node.names:
        # `from pkg import sub` loads the submodule when there is one, else the package.
        sub = f"{base}.{alias.name}"
        yield sub if sub in MODULES else base


def _dynamic_targets(call: ast.Call) -> Iterator[str]:
    """Targets of ``importlib.import_module(...)`` / ``import_module(...)`` readable statically."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name != "import_module" or not call.args:
        return
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        yield arg.value
    elif isinstance(arg, ast.JoinedStr) and arg.values:
        head = arg.values[0]
        if isinstance(head, ast.Constant) and isinstance(head.value, str):
            prefix = head.value
            if prefix.endswith("."):
                yield from (m for m in MODULES if m.startswith(prefix))


def _imports(module: str) -> tuple[set[str], set[str], set[str]]:
    """dselectk modules imported (anywhere; when run: module level or in functions, not under
    ``if TYPE_CHECKING:``; via importlib)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"), str(MODULES[module]))
    everything: set[str] = set()
    runtime: set[str] = set()
    dynamic: set[str] = set()

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _static_targets(node, module):
                resolved = _resolve(target)
                if resolved is None:
                    continue
                everything.add(resolved)
                if not type_checking:
                    runtime.add(resolved)
        elif isinstance(node, ast.Call):
            for target in _dynamic_targets(node):
                resolved = _resolve(target)
                if resolved is not None:
                    everything.add(resolved)
                    dynamic.add(resolved)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_checking)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    visit(tree, False)
    for found in (everything, runtime, dynamic):
        found.discard(module)
    return everything, runtime, dynamic


IMPORTS = {m: _imports(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def _graph(skip_dynamic: set[str]) -> dict[str, set[str]]:
    """The graph of imports that run (module level and in functions); the importlib imports of
    the ``skip_dynamic`` modules left out."""
    return {m: IMPORTS[m][1] | (set() if m in skip_dynamic else IMPORTS[m][2]) for m in MODULES}


# --------------------------------------------------------------------------------------------
# the rules
# --------------------------------------------------------------------------------------------


def test_the_tree_has_the_layers() -> None:
    for group in ("gates", "layers", "models", "integrations"):
        assert f"dselectk.{group}" in PACKAGES
    assert "dselectk_research" in PACKAGES
    assert {_group(m) for m in MODULES} <= set(ALLOWED)


def test_the_library_never_imports_the_research_part() -> None:
    for module, path in MODULES.items():
        if _group(module) == "research":
            continue
        wrong = sorted(t for t in IMPORTS[module][0] if _group(t) == "research")
        assert not wrong, f"the library module {module} imports the research part: {wrong}"
        assert "dselectk_research" not in path.read_text(encoding="utf-8"), (
            f"{path} names dselectk_research (the library must not depend on the research part)"
        )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_stack(module: str) -> None:
    group = _group(module)
    allowed = ALLOWED[group] | {group}
    wrong = sorted(t for t in IMPORTS[module][0] if _group(t) not in allowed)
    assert not wrong, (
        f"{module} ({group}) imports {[(t, _group(t)) for t in wrong]}; "
        f"{group} may import only {sorted(allowed)}"
    )


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph(set()))
    assert not cycles, f"import cycles between modules: {cycles}"


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_cycle_check_counts_imports_inside_functions() -> None:
    graph = _graph(set())
    found = 0
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                for target in _static_targets(node, module):
                    resolved = _resolve(target)
                    if resolved is not None and resolved != module:
                        assert resolved in graph[module], (module, resolved)
                        found += 1
    assert found, "no function-level import in the tree: this test would check nothing"
