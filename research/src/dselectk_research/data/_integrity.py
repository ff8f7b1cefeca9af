"""Verification of local data files, its cache, and data fingerprints.

Every file the registry (:mod:`dselectk_research.data._files`) knows has an expected SHA-256 (or,
for
ML-1M ``ratings.dat``, git blob hash) and usually a size. A local file is checked against them
on first use; a mismatch raises :class:`ChecksumError` naming the file, the expected and actual
size and checksum, and what to do. Files the registry does not know are used as they are, with
one warning per file and process.

Hashing a file costs one read of it. The digests are cached by ``(path, size, mtime_ns)``: in
memory for the process, and in ``<data_dir>/.dselectk-verified.json`` (written atomically with
:func:`dselectk.io.write_json`) so later processes do not re-hash either. A data directory that
is read-only (no write permission bits, or not writable by this user) or a cache that cannot be
written only keeps the in-memory cache; a missing or unreadable cache file is ignored. A file
that changes (size or mtime) is hashed again.

:func:`fingerprint` turns the files a data set was built from into a short stable hash, so run
records can say which data they used.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dselectk.io import write_json

__all__ = [
    "CACHE_NAME",
    "VERIFY_ENV_VAR",
    "ChecksumError",
    "Expected",
    "PartialDataWarning",
    "check_file",
    "fingerprint",
    "verify_enabled",
]

CACHE_NAME = ".dselectk-verified.json"
"""Name of the digest cache kept in the data directory."""

VERIFY_ENV_VAR = "DSELECTK_VERIFY"
"""Set to ``0`` / ``false`` / ``no`` / ``off`` to skip checksum verification by default."""

_CACHE_VERSION = 1
_CHUNK = 1 << 20
_FINGERPRINT_TAG = b"dselectk-data-fingerprint-v1\n"

# (resolved path, size, mtime_ns) -> {"sha256": ..., "git_blob_sha1": ...}
_MEMO: dict[tuple[str, int, int], dict[str, str]] = {}
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


def _stat_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path.resolve()), int(st.st_size), int(st.st_mtime_ns)


def _read_cache(root: Path) -> dict[str, dict[str, object]]:
    try:
        raw = json.loads((root / CACHE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict) or raw.get("version") != _CACHE_VERSION:
        return {}
    files = raw.get("files")
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if isinstance(k, str) and isinstance(v, dict)}


def _writable(root: Path) -> bool:
    """Whether the cache may be written: the folder has write bits and we may write to it."""
    try:
        mode = root.stat().st_mode
    except OSError:
        return False
    return bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)) and os.access(root, os.W_OK)


def _write_cache(root: Path, rel: str, size: int, mtime_ns: int, digests: dict[str, str]) -> None:
    if not _writable(root):
        return
    files = _read_cache(root)
    files[rel] = {"size": size, "mtime_ns": mtime_ns, **digests}
    try:
        write_json(root / CACHE_NAME, {"version": _CACHE_VERSION, "files": files})
    except OSError:
        pass  # read-only, full or otherwise unwritable: the in-memory cache is enough


def _rel(path: Path, root: Path | None) -> str | None:
    if root is None:
        return None
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except (OSError, ValueError):
        return None


def digests(
    path: Path, root: Path | None = None, need: Iterable[str] = ("sha256",), persist: bool = True
) -> dict[str, str]:
    """Digests of ``path`` (cached in memory and, under ``root``, on disk).

    Args:
        path: File to hash.
        root: Data directory holding the on-disk cache, or None for the in-memory cache only.
        need: Digests wanted (``"sha256"``, ``"git_blob_sha1"``).
        persist: Whether newly computed digests may be written to the on-disk cache.
    """
    need = tuple(need)
    key = _stat_key(path)
    have = dict(_MEMO.get(key, {}))
    if all(a in have for a in need):
        return have
    rel = _rel(path, root)
    if root is not None and rel is not None:
        entry = _read_cache(root).get(rel)
        if entry and entry.get("size") == key[1] and entry.get("mtime_ns") == key[2]:
            have.update({a: str(entry[a]) for a in ("sha256", "git_blob_sha1") if a in entry})
            if all(a in have for a in need):
                _MEMO[key] = have
                return have
    have.update(_digest_file(path, [a for a in need if a not in have]))
    # The file may have changed while it was read; only cache what is still current.
    if _stat_key(path) == key:
        _MEMO[key] = have
        if persist and root is not None and rel is not None:
            _write_cache(root, rel, key[1], key[2], have)
    return have


def remember(path: Path, found: Mapping[str, str]) -> None:
    """Record digests just computed elsewhere (a verified download) in the in-memory cache."""
    key = _stat_key(path)
    _MEMO[key] = {**_MEMO.get(key, {}), **found}


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
    root: Path,
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
    got = digests(path, root, need)
    ok = (
        (expected.size is None or size == expected.size)
        and (expected.sha256 is None or got["sha256"] == expected.sha256)
        and (expected.git_blob_sha1 is None or got["git_blob_sha1"] == expected.git_blob_sha1)
    )
    if not ok:
        raise ChecksumError(_mismatch_message(name, path, expected, size, got, known))


def fingerprint(
    paths: Iterable[str | os.PathLike[str]], data_dir: str | os.PathLike[str] | None = None
) -> str:
    """A short stable hash of the contents of the data files ``paths``.

    It depends only on each file's name (its last path component) and its SHA-256, not on the
    folder the files are in or the order they are given in: the same data in another data
    directory has the same fingerprint, and changing, truncating or swapping any file changes
    it. The loaders report it as ``MovieLensData.fingerprint`` / ``MultiMNISTData.fingerprint``
    (the fingerprint of the files they read), for run records to carry, so that a resumed run
    can tell that its data changed.

    Digests come from the verification cache (see :mod:`dselectk_research.data._integrity`), so
    after a
    loader has read the files this costs nothing; otherwise each file is read once.

    Args:
        paths: The data files (at least one).
        data_dir: Data directory whose on-disk digest cache may be used for files inside it.

    Returns:
        16 lowercase hex digits.

    Raises:
        ValueError: If ``paths`` is empty.
        FileNotFoundError: If a file does not exist.
    """
    root = Path(data_dir).expanduser() if data_dir is not None else None
    lines = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(2, f"data file {path} does not exist", str(path))
        lines.append(f"{path.name}\t{digests(path, root)['sha256']}\n")
    if not lines:
        raise ValueError("fingerprint needs at least one file")
    h = hashlib.sha256(_FINGERPRINT_TAG)
    for line in sorted(lines):
        h.update(line.encode("utf-8"))
    return h.hexdigest()[:16]
