"""Low-level text helpers shared by the MovieLens parsers.

Reading a (possibly gzip-compressed) file as text, splitting it into lines, parsing integer
tables fast (with a slow path naming the first malformed line) and the range / uniqueness
checks whose errors name the file and line number.
"""

from __future__ import annotations

import gzip
import io
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dselectk_research.data.movielens.schema import IntArray


def _read_text(path: Path, encoding: str) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError) as exc:
            raise ValueError(f"{path}: corrupt or truncated gzip data: {exc}") from exc
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not valid {encoding} text: {exc}") from exc
    return text.replace("\r\n", "\n")


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    while lines and lines[-1] == "":
        lines.pop()
    return lines


def _malformed(path: Path, lineno: int, expected: str, line: str) -> ValueError:
    shown = line if len(line) <= 80 else line[:77] + "..."
    return ValueError(f"{path}, line {lineno}: malformed line, expected {expected}; got {shown!r}")


def _parse_int_table(
    path: Path,
    text: str,
    sep: str,
    ncols: int,
    first_line: int = 1,
    empty_ok: Sequence[int] = (),
) -> IntArray:
    """Parse ``text`` as rows of ``ncols`` ``sep``-separated integers.

    Empty fields in the columns listed in ``empty_ok`` become ``-1``. ``first_line`` is the
    1-based file line number of the first line of ``text`` (used in error messages).
    """
    expected = f"{ncols} {sep!r}-separated integer fields"
    body = text.rstrip("\n")
    if not body:
        return np.zeros((0, ncols), dtype=np.int64)
    fast = "\n\n" not in body and not body.startswith("\n")
    if sep == "::":
        # Map "::" to a single-character delimiter, but only when no stray ':' would merge.
        fast = fast and body.count(":") == 2 * body.count("::") and ":::" not in body
        fast_text, delim = body.replace("::", ":"), ":"
    else:
        fast_text, delim = body, sep
    if empty_ok and fast:
        # Only one column may be empty in our formats; mark it with -1 for loadtxt.
        col = empty_ok[0]
        if len(empty_ok) != 1 or not 0 < col < ncols - 1:
            raise RuntimeError("internal error: unsupported empty_ok specification")
        fast_text = fast_text.replace(delim + delim, delim + "-1" + delim)
    if fast:
        try:
            arr = np.loadtxt(io.StringIO(fast_text), delimiter=delim, dtype=np.int64, ndmin=2)
        except ValueError:
            pass
        else:
            if arr.shape[1] == ncols and arr.shape[0] == body.count("\n") + 1:
                return arr
    # Slow path: find (and report) the first malformed line.
    rows: list[list[int]] = []
    for offset, line in enumerate(body.split("\n")):
        lineno = first_line + offset
        parts = line.split(sep)
        if len(parts) != ncols:
            raise _malformed(path, lineno, expected, line)
        row: list[int] = []
        for j, part in enumerate(parts):
            if part == "" and j in empty_ok:
                row.append(-1)
                continue
            try:
                row.append(int(part))
            except ValueError:
                raise _malformed(path, lineno, expected, line) from None
        rows.append(row)
    return np.asarray(rows, dtype=np.int64).reshape(-1, ncols)


def _check_values(
    path: Path, values: IntArray, lo: int, hi: int, what: str, first_line: int = 1
) -> None:
    bad = np.flatnonzero((values < lo) | (values > hi))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{path}, line {first_line + i}: {what} must be in {lo}..{hi}, got {values[i]}"
        )


def _check_ids(path: Path, values: IntArray, what: str, first_line: int = 1) -> None:
    _check_values(path, values, 1, np.iinfo(np.int64).max, what, first_line)


def _as_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(2, f"MovieLens file {p} does not exist", str(p))
    return p


def _check_unique(path: Path, ids: IntArray, what: str) -> None:
    _, first, counts = np.unique(ids, return_index=True, return_counts=True)
    if np.any(counts > 1):
        dup_val = ids[first[counts > 1][0]]
        line = int(np.flatnonzero(ids == dup_val)[1]) + 1
        raise ValueError(f"{path}, line {line}: duplicate {what} {dup_val}")
