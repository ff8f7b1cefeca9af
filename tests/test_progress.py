"""dselectk.progress: tqdm when installed, a silent stand-in otherwise."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator

import pytest

import dselectk.progress as progress


@pytest.fixture
def without_tqdm(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """dselectk.progress re-imported as if tqdm were not installed (restored afterwards)."""
    for name in [m for m in sys.modules if m == "tqdm" or m.startswith("tqdm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    mod = importlib.reload(progress)
    yield mod
    monkeypatch.undo()
    importlib.reload(progress)


def test_with_tqdm_is_tqdm_auto() -> None:
    auto = pytest.importorskip("tqdm.auto")
    assert progress.HAVE_TQDM and progress.tqdm is auto.tqdm
    with progress.tqdm(range(3), desc="x", unit="it", leave=False, disable=True) as bar:
        assert list(bar) == [0, 1, 2]


def test_without_tqdm_is_silent(without_tqdm, capsys: pytest.CaptureFixture[str]) -> None:
    mod = without_tqdm
    assert not mod.HAVE_TQDM and mod.tqdm is mod.SilentTqdm
    bar = mod.tqdm(range(4), desc="d", unit="ep", leave=False, position=1, disable=False)
    assert bar.total == 4 and len(bar) == 4
    assert list(bar) == [0, 1, 2, 3] and bar.n == 4
    with mod.tqdm(total=10, desc="cells", mininterval=1.0) as b2:
        b2.update()
        b2.update(3)
        b2.set_postfix({"loss": 0.5}, acc=1)
        b2.set_postfix_str("k 3s")
        b2.set_description("new")
        b2.refresh()
        assert b2.n == 4 and b2.postfix == "k 3s" and b2.desc == "new"
    mod.tqdm.set_lock(mod.tqdm.get_lock())
    mod.tqdm.write("a message")
    out = capsys.readouterr()
    assert out.out == "a message\n" and out.err == ""
    assert list(mod.tqdm([5, 6])) == [5, 6]  # iterable as the only argument


def test_after_restore() -> None:
    auto = pytest.importorskip("tqdm.auto")
    assert progress.tqdm is auto.tqdm
