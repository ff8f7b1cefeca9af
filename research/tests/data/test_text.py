"""The byte-stream text corpus (:mod:`dselectk_research.data.text`): the stdlib's source, read the
same
way every time, split into a training and a validation part."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dselectk_research.data import Corpus, load_corpus


def _tree(root: Path) -> None:
    for rel, text in {
        "b.py": "bb",
        "a/x.py": "aaaa",
        "test/t.py": "skipped",
        "site-packages/p.py": "skipped",
        "a/tests/u.py": "skipped",
        "c.txt": "not python",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_reads_whole_py_files_in_sorted_order_and_splits_the_stream(tmp_path: Path) -> None:
    _tree(tmp_path)
    c = load_corpus(100, val_fraction=0.5, root=tmp_path)
    assert isinstance(c, Corpus) and c.files == ["a/x.py", "b.py"] and c.root == str(tmp_path)
    assert bytes(c.train.tolist()) == b"aaa" and bytes(c.val.tolist()) == b"abb"
    assert c.train.dtype == torch.long


def test_stops_after_the_byte_budget_and_hashes_what_it_read(tmp_path: Path) -> None:
    _tree(tmp_path)
    a, b = load_corpus(3, val_fraction=0.0, root=tmp_path), load_corpus(4, 0.0, root=tmp_path)
    assert a.files == b.files == ["a/x.py"] and len(a.train) == 3 and len(a.val) == 0
    assert a.sha256 == b.sha256 and a.content_sha256 != b.content_sha256


def test_an_empty_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no \*\.py files"):
        load_corpus(100, root=tmp_path)


def test_the_default_is_the_stdlib_source() -> None:
    c = load_corpus(20_000)
    assert len(c.train) + len(c.val) == 20_000 and len(c.val) == 2_000
    assert not any("site-packages" in f or f.startswith("test/") for f in c.files)
