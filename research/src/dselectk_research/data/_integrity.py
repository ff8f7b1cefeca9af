"""Verification of local data files, its cache, and data fingerprints.

Every file the registry (:mod:`dselectk_research.data._files`) knows has an expected SHA-256 (or,
for
ML-1M ``ratings.dat``, git blob hash) and usually a size. A local file is checked against them
on every use; a mismatch raises :class:`ChecksumError` naming the file, the expected and actual
size and checksum, and what to do. Files the registry does not know are used as they are, with
one warning per file and process.

A file's identity is its content: every use reads and hashes it (one read, all the digests
needed in one pass; MovieLens-1M's 24 MB take a tenth of a second). Nothing is trusted from its
size or timestamp, so an edit of the same size whose timestamp was put back is still caught.

:func:`fingerprint` turns the files a data set was built from into a short stable hash, so run
records can say which data they used.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "VERIFY_ENV_VAR",
    "ChecksumError",
    "Expected",
    "PartialDataWarning",
    "check_file",
    "fingerprint",
    "verify_enabled",
]

VERIFY_ENV_VAR = "DSELECTK_VERIFY"
"""Set to ``0`` / ``false`` / ``no`` / ``off`` to skip checksum verification by default."""

_CHUNK = 1 << 20
_FINGERPRINT_TAG = b"dselectk-data-fingerprint-v1\n"

# Resolved paths of unknown files already warned about.
_WARNED: set[str] = set()
_ENV_WARNED: list[bool] = []


class ChecksumError(ValueError):
    """A data file does not have its expected checksum (or size), or is not a valid archive."""


class PartialDataWarning(UserWarning):
    """A partial form of a data set was used without being asked for by name."""


@dataclass(frozen=True)
class Expected:
    """What a known file must look like: any of SHA-256, git blob SHA-1 and size in bytes."""

    sha256: str | None = None
    git_blob_sha1: str | None = None
    size: int | None = None


def verify_enabled(verify: bool | None) -> bool:
    """Resolve a loader's ``verify`` argument: None means "unless ``$DSELECTK_VERIFY`` is off"."""
    if verify is not None:
        return bool(verify)
    value = os.environ.get(VERIFY_ENV_VAR, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        if not _ENV_WARNED:
            _ENV_WARNED.append(True)
            warnings.warn(
                f"checksum verification of data files is disabled by {VERIFY_ENV_VAR}={value}: "
                "local files are used as they are",
                UserWarning,
                stacklevel=3,
            )
        return False
    return True


def _digest_file(path: Path, algorithms: Iterable[str]) -> dict[str, str]:
    """Hash ``path`` in one pass; algorithms are ``"sha256"`` and ``"git_blob_sha1"``."""
    hashers: dict[str, Any] = {}
    for alg in algorithms:
        if alg == "sha256":
            hashers[alg] = hashlib.sha256()
        elif alg == "git_blob_sha1":
            h = hashlib.sha1(usedforsecurity=False)
            h.update(b"blob %d\0" % path.stat().st_size)
            hashers[alg] = h
        else:
            raise ValueError(f"unknown digest {alg!r}")
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            for h in hashers.values():
                h.update(chunk)
    return {alg: h.hexdigest() for alg, h in hashers.items()}


def digests(path: Path, need: Iterable[str] = ("sha256",)) -> dict[str, str]:
    """The digests ``need`` (``"sha256"``, ``"git_blob_sha1"``) of ``path``'s content, read
    now (never from a cache keyed by size or timestamp)."""
    return _digest_file(path, tuple(dict.fromkeys(need)))


def _warn_unknown(name: str, path: Path) -> None:
    resolved = str(path.resolve())
    if resolved in _WARNED:
        return
    _WARNED.add(resolved)
    warnings.warn(
        f"data file {name!r} at {path} is not in dselectk's registry of known files, so its "
        "checksum cannot be verified: it is used as it is",
        UserWarning,
        stacklevel=4,
    )


def _mismatch_message(
    name: str,
    path: Path,
    expected: Expected,
    size: int,
    got: dict[str, str],
    known: Mapping[str, Expected],
) -> str:
    parts = []
    if expected.size is not None and size != expected.size:
        what = "smaller: truncated?" if size < expected.size else "larger"
        parts.append(f"size {size} bytes, expected {expected.size} ({what})")
    else:
        parts.append(f"size {size} bytes")
    if expected.sha256 is not None:
        parts.append(f"sha256 {got['sha256']}, expected {expected.sha256}")
    if expected.git_blob_sha1 is not None and "git_blob_sha1" in got:
        parts.append(f"git blob sha1 {got['git_blob_sha1']}, expected {expected.git_blob_sha1}")
    msg = (
        f"Data file {name!r} at {path.absolute()} is not the known file: " + "; ".join(parts) + ". "
    )
    same = [n for n, e in known.items() if e.sha256 is not None and e.sha256 == got["sha256"]]
    if same:
        msg += f"Its content is that of {same[0]!r}: it is in the wrong folder. "
    msg += (
        "Delete it to have it downloaded again (download=True), or pass the data directory "
        f"that holds the right file (data_dir= or $DSELECTK_DATA). To use your own copy as "
        f"it is, pass verify=False (or set {VERIFY_ENV_VAR}=0)."
    )
    return msg


def check_file(
    name: str,
    path: Path,
    expected: Expected | None,
    known: Mapping[str, Expected],
) -> None:
    """Verify the local file ``path`` (registry name ``name``) against ``expected``.

    Unknown files (``expected is None``) only warn, once per file and process.

    Raises:
        ChecksumError: If the size or a checksum differs from the expected one.
    """
    if expected is None or (expected.sha256 is None and expected.git_blob_sha1 is None):
        _warn_unknown(name, path)
        return
    need = ["sha256"]
    if expected.git_blob_sha1 is not None:
        need.append("git_blob_sha1")
    size = path.stat().st_size
    got = digests(path, need)
    ok = (
        (expected.size is None or size == expected.size)
        and (expected.sha256 is None or got["sha256"] == expected.sha256)
        and (expected.git_blob_sha1 is None or got["git_blob_sha1"] == expected.git_blob_sha1)
    )
    if not ok:
        raise ChecksumError(_mismatch_message(name, path, expected, size, got, known))


def fingerprint(paths: Iterable[str | os.PathLike[str]]) -> str:
    """A short stable hash of the contents of the data files ``paths``.

    It depends only on each file's name (its last path component) and its SHA-256, not on the
    folder the files are in or the order they are given in: the same data in another data
    directory has the same fingerprint, and changing, truncating or swapping any file changes
    it. The loaders report it as ``MovieLensData.fingerprint`` / ``MultiMNISTData.fingerprint``
    (the fingerprint of the files they read), for run records to carry, so that a resumed run
    can tell that its data changed.

    Each file is read once (its content is its identity, see
    :mod:`dselectk_research.data._integrity`).

    Args:
        paths: The data files (at least one).

    Returns:
        16 lowercase hex digits.

    Raises:
        ValueError: If ``paths`` is empty.
        FileNotFoundError: If a file does not exist.
    """
    lines = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(2, f"data file {path} does not exist", str(path))
        lines.append(f"{path.name}\t{digests(path)['sha256']}\n")
    if not lines:
        raise ValueError("fingerprint needs at least one file")
    h = hashlib.sha256(_FINGERPRINT_TAG)
    for line in sorted(lines):
        h.update(line.encode("utf-8"))
    return h.hexdigest()[:16]
