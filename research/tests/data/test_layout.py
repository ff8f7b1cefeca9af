"""Layout of :mod:`dselectk_research.data`: the MovieLens package's re-exports and import
hygiene."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dselectk_research.data
from dselectk_research.data import movielens

DATA_SRC = Path(dselectk_research.data.__file__).resolve().parent

# Every public name of the former single-module ``dselectk_research.data.movielens``.
MOVIELENS_NAMES = (
    "AGE_BUCKETS", "ML1M_GENRES", "ML1M_OCCUPATIONS", "ML1M_RATINGS_SOURCES", "ML100K_GENRES",
    "ML100K_OCCUPATIONS", "MOVIELENS_VARIANTS", "IntArray", "ItemIndexMap", "Items",
    "MovieLensData", "MovieLensSplit", "Ratings", "Users", "load_movielens",
    "read_ml1m_item_index_map", "read_ml1m_movies", "read_ml1m_ratings",
    "read_ml1m_ratings_no_timestamps", "read_ml1m_users", "read_ml100k_items",
    "read_ml100k_ratings", "read_ml100k_users", "sample_negatives",
)  # fmt: skip


def test_movielens_package_reexports_every_public_name() -> None:
    assert set(movielens.__all__) == set(MOVIELENS_NAMES)
    for name in MOVIELENS_NAMES:
        assert getattr(movielens, name) is not None, name
        if name in dselectk_research.data.__all__:
            assert getattr(dselectk_research.data, name) is getattr(movielens, name), name


FORBIDDEN = ("dselectk.models", "dselectk.training", "dselectk.cli", "tqdm", "matplotlib")


def _forbidden(module: str) -> bool:
    """Models, training, the CLI, plotting, and any research module outside the data loaders (the
    package root ``dselectk_research`` holds a docstring only)."""
    if module.split(".")[0] == "dselectk_research" and module != "dselectk_research":
        return not (
            module == "dselectk_research.data" or module.startswith("dselectk_research.data.")
        )
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def _module_level_imports(tree: ast.Module) -> list[str]:
    """Modules imported by statements run at import time (not inside functions or classes)."""
    found: list[str] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    todo += child.body if isinstance(child, ast.ExceptHandler) else [child]
    return found


def test_data_modules_import_no_models_experiments_or_plotting() -> None:
    for path in sorted(DATA_SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bad = [m for m in _module_level_imports(tree) if _forbidden(m)]
        assert not bad, f"{path.relative_to(DATA_SRC)} imports {bad} at module level"


def test_importing_data_adds_no_models_experiments_or_plotting() -> None:
    # ``import dselectk`` (the parent package, run first by any ``import dselectk_research.data``)
    # has its
    # own imports; check only what importing the data loaders adds on top.
    code = (
        "import sys, dselectk\n"
        "before = set(sys.modules)\n"
        "import dselectk_research.data, dselectk_research.data.movielens\n"
        "import dselectk_research.data.mnist\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    added = ast.literal_eval(out.stdout.strip())
    assert "dselectk_research.data.movielens.dataset" in added
    assert not [m for m in added if _forbidden(m)], added
