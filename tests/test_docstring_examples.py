"""Every public class and function of the library has a runnable example in its docstring, and
every example runs and prints what it says (doctest).

Public: the names in a module's ``__all__`` that the module defines (classes and functions).
Modules that are not API (kernels, the CLI, test helpers) are listed in :data:`NOT_API`; a module
whose examples are still being written is listed in :data:`PENDING` — the test fails for a module
in neither list whose public objects lack an example.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import pkgutil

import pytest
import torch

import dselectk

#: modules that are not part of the API reference (implementation, CLI, test helpers)
NOT_API = {
    "dselectk._argtypes",
    "dselectk._testing",
    "dselectk.cli",
    "dselectk.progress",
    "dselectk.kernels",
}

#: modules whose public objects do not all carry an example yet (shrinks to empty)
PENDING: set[str] = set()

#: optional extras whose examples are skipped when the extra is not installed:
#: object-name prefix -> the modules the examples import
NEEDS: dict[str, tuple[str, ...]] = {
    "dselectk.integrations.": ("transformers",),
    "dselectk.export.to_onnx": ("onnxruntime", "onnxscript"),
}


def _api_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(dselectk.__path__, "dselectk."):
        if any(info.name == m or info.name.startswith(m + ".") for m in NOT_API):
            continue
        names.append(info.name)
    return sorted(names)


def _public_objects(module_name: str) -> list[tuple[str, object]]:
    mod = importlib.import_module(module_name)
    out = []
    for name in getattr(mod, "__all__", ()):
        obj = getattr(mod, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) != module_name:
            continue  # re-exported: checked where it is defined
        out.append((f"{module_name}.{name}", obj))
    return out


def _examples(obj: object, name: str) -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(recurse=False)
    return [t for t in finder.find(obj, name) if t.examples]


MODULES = _api_modules()
OBJECTS = [pair for m in MODULES for pair in _public_objects(m)]


def test_pending_modules_exist() -> None:
    assert PENDING <= set(MODULES), sorted(PENDING - set(MODULES))


@pytest.mark.parametrize("module_name", [m for m in MODULES if m not in PENDING])
def test_every_public_object_has_an_example(module_name: str) -> None:
    missing = [n for n, obj in _public_objects(module_name) if not _examples(obj, n)]
    assert not missing, f"public objects without a '>>>' example: {missing}"


@pytest.mark.parametrize("name,obj", OBJECTS, ids=[n for n, _ in OBJECTS])
def test_examples_run(name: str, obj: object) -> None:
    tests = _examples(obj, name)
    if not tests:
        pytest.skip("no example yet (module in PENDING)")
    for prefix, needs in NEEDS.items():
        absent = [m for m in needs if importlib.util.find_spec(m) is None]
        if name.startswith(prefix) and absent:
            pytest.skip(f"needs {', '.join(absent)} (an optional extra), not installed")
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    failures: list[str] = []
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    try:
        for t in tests:
            runner.run(t, out=failures.append)
    finally:
        torch.set_num_threads(threads)
    assert runner.failures == 0, "".join(failures)
