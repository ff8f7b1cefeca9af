"""dselectk.io: the atomic writers."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from dselectk import io


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_writers_create_parents_and_round_trip(tmp_path: Path) -> None:
    assert io.write_bytes(tmp_path / "a" / "b.bin", b"\x00\x01") == tmp_path / "a" / "b.bin"
    assert (tmp_path / "a" / "b.bin").read_bytes() == b"\x00\x01"
    io.write_text(tmp_path / "t" / "x.txt", "héllo\nworld\n")
    assert (tmp_path / "t" / "x.txt").read_bytes() == "héllo\nworld\n".encode()
    io.save_torch(tmp_path / "c" / "ck.pt", {"w": torch.arange(3)})
    assert torch.equal(torch.load(tmp_path / "c" / "ck.pt")["w"], torch.arange(3))
    io.save_npz(tmp_path / "n" / "arr.npz", x=np.arange(4), y=np.ones(2))
    with np.load(tmp_path / "n" / "arr.npz") as z:
        assert z["x"].tolist() == [0, 1, 2, 3] and z["y"].tolist() == [1.0, 1.0]
    assert _names(tmp_path / "n") == ["arr.npz"]  # no .npz appended, no temp left


def test_write_json_format_is_byte_identical_to_records(tmp_path: Path) -> None:
    obj = {"b": [1, 2.5, math.nan], "a": {"z": math.inf, 3: (1, 2)}, "t": torch.tensor([1.5])}
    io.write_json(tmp_path / "x.json", obj)
    expected = (
        json.dumps(
            {"a": {"3": [1, 2], "z": None}, "b": [1, 2.5, None], "t": [1.5]},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    assert (tmp_path / "x.json").read_text() == expected
    io.write_json(tmp_path / "c.json", [1], indent=None)
    assert (tmp_path / "c.json").read_text() == "[1]\n"


def test_exception_mid_write_keeps_old_file_and_removes_temp(tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    io.save_torch(path, {"v": 1})
    old = path.read_bytes()
    # torch.save has written part of the archive when pickling the lambda fails
    with pytest.raises(Exception):  # noqa: B017 - the pickling error type varies by version
        io.save_torch(path, {"big": torch.zeros(1000), "f": lambda: 0})
    assert path.read_bytes() == old
    assert _names(tmp_path) == ["ck.pt"]


def test_keyboard_interrupt_removes_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.txt"
    io.write_text(path, "old")

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        io.write_text(path, "new")
    assert path.read_text() == "old"
    assert _names(tmp_path) == ["x.txt"]


def test_failed_rename_removes_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(src: str, dst: str) -> None:
        assert Path(src).name.startswith(f".x.bin.{io.HOST}-{os.getpid()}.")
        assert src.endswith(".tmp")
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk gone"):
        io.write_bytes(tmp_path / "x.bin", b"1")
    assert _names(tmp_path) == []
