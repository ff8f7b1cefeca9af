"""Data-directory resolution, local lookup and checksummed downloads.

Every dataset file is addressed by a *name*: its path relative to the data directory, using the
same layout as upstream (and as ``shared/data`` in this project)::

    mnist/train-images-idx3-ubyte.gz
    fashion-mnist/t10k-labels-idx1-ubyte.gz
    movielens/ml-100k/u.data
    movielens/ml-1m/users.dat

The data directory is, in order of precedence: the ``data_dir`` argument, the ``DSELECTK_DATA``
environment variable, and ``~/.cache/dselectk``.

Downloads go to a temporary file in the destination directory, are verified, and are then moved
into place with :func:`os.replace`, so a failed or interrupted download never leaves a partial
file under the final name. Synthetic data is never substituted for a missing file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = [
    "DATA_ENV_VAR",
    "DEFAULT_DATA_DIR",
    "ChecksumError",
    "fetch",
    "known_files",
    "resolve_data_dir",
]

DATA_ENV_VAR = "DSELECTK_DATA"
"""Environment variable naming the data directory."""

DEFAULT_DATA_DIR = Path("~/.cache/dselectk")
"""Data directory used when neither the argument nor the environment variable is set."""

_CHUNK = 1 << 20


class ChecksumError(ValueError):
    """A downloaded file does not have the expected checksum (or is not a valid archive)."""


@dataclass(frozen=True)
class _Remote:
    """Where a named file comes from and how to verify it.

    Attributes:
        url: Upstream URL of the file itself, or of the zip archive holding it.
        sha256: Expected SHA-256 of the file as stored locally, if known.
        git_blob_sha1: Expected git blob hash (SHA-1 of ``b"blob <size>\\0" + content``), used
            where only that is published.
        member: When set, ``url`` is a zip archive and this is the member path inside it.
        archive_name: Local name (relative to the data directory) of the downloaded archive.
    """

    url: str
    sha256: str | None = None
    git_blob_sha1: str | None = None
    member: str | None = None
    archive_name: str | None = None


_MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
_FASHION_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_ML100K_URL = "https://files.grouplens.org/datasets/movielens/ml-100k.zip"
_ML1M_URL = "https://files.grouplens.org/datasets/movielens/ml-1m.zip"

# SHA-256 values are those of the byte-identical official files recorded in
# shared/data/PROVENANCE.md (their MD5s match the published torchvision checksums).
_REMOTES: dict[str, _Remote] = {
    "mnist/train-images-idx3-ubyte.gz": _Remote(
        _MNIST_URL + "train-images-idx3-ubyte.gz",
        sha256="440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    ),
    "mnist/train-labels-idx1-ubyte.gz": _Remote(
        _MNIST_URL + "train-labels-idx1-ubyte.gz",
        sha256="3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    ),
    "mnist/t10k-images-idx3-ubyte.gz": _Remote(
        _MNIST_URL + "t10k-images-idx3-ubyte.gz",
        sha256="8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    ),
    "mnist/t10k-labels-idx1-ubyte.gz": _Remote(
        _MNIST_URL + "t10k-labels-idx1-ubyte.gz",
        sha256="f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
    ),
    "fashion-mnist/train-images-idx3-ubyte.gz": _Remote(
        _FASHION_URL + "train-images-idx3-ubyte.gz",
        sha256="3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
    ),
    "fashion-mnist/train-labels-idx1-ubyte.gz": _Remote(
        _FASHION_URL + "train-labels-idx1-ubyte.gz",
        sha256="a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
    ),
    "fashion-mnist/t10k-images-idx3-ubyte.gz": _Remote(
        _FASHION_URL + "t10k-images-idx3-ubyte.gz",
        sha256="346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
    ),
    "fashion-mnist/t10k-labels-idx1-ubyte.gz": _Remote(
        _FASHION_URL + "t10k-labels-idx1-ubyte.gz",
        sha256="67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
    ),
    # MovieLens files are members of the GroupLens zip archives. We do not know a trustworthy
    # checksum of the archives themselves, so the archive is only checked for integrity (zip CRCs
    # via ZipFile.testzip); each extracted member is then verified against the SHA-256 recorded in
    # PROVENANCE.md. For ml-1m/ratings.dat only the git blob hash is published, so that is checked.
    "movielens/ml-100k/u.data": _Remote(
        _ML100K_URL,
        sha256="06416e597f82b7342361e41163890c81036900f418ad91315590814211dca490",
        member="ml-100k/u.data",
        archive_name="movielens/ml-100k.zip",
    ),
    "movielens/ml-100k/u.item": _Remote(
        _ML100K_URL,
        sha256="553841ebc7de3a0fd0d6b62a204ea30c1e651aacfb2814c7a6584ac52f2c5701",
        member="ml-100k/u.item",
        archive_name="movielens/ml-100k.zip",
    ),
    "movielens/ml-100k/u.user": _Remote(
        _ML100K_URL,
        sha256="f120e114da2e8cf314fd28f99417c94ae9ddf1cb6db8ce0e4b5995d40e90e62c",
        member="ml-100k/u.user",
        archive_name="movielens/ml-100k.zip",
    ),
    "movielens/ml-1m/movies.dat": _Remote(
        _ML1M_URL,
        sha256="0140fc2356357c1a851d0f52e893a1e4d3696df632c4141cea8d5bc3d621f0b9",
        member="ml-1m/movies.dat",
        archive_name="movielens/ml-1m.zip",
    ),
    "movielens/ml-1m/users.dat": _Remote(
        _ML1M_URL,
        sha256="1dc3a95300cb19f7c10e027daf29b8cdf1d908dab65b5edfb45950aa389a10a3",
        member="ml-1m/users.dat",
        archive_name="movielens/ml-1m.zip",
    ),
    "movielens/ml-1m/ratings.dat": _Remote(
        _ML1M_URL,
        git_blob_sha1="77a7c4b150f588c23bb9e1f068aa996c0b413695",
        member="ml-1m/ratings.dat",
        archive_name="movielens/ml-1m.zip",
    ),
}


def known_files() -> list[str]:
    """Names of the files that :func:`fetch` knows how to download.

    Returns:
        Sorted list of file names relative to the data directory.
    """
    return sorted(_REMOTES)


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Resolve the data directory.

    Args:
        data_dir: Explicit directory. Takes precedence over everything else.

    Returns:
        ``data_dir`` if given, else ``$DSELECTK_DATA`` if set and non-empty, else
        ``~/.cache/dselectk``; with ``~`` expanded. The directory need not exist.

    Raises:
        TypeError: If ``data_dir`` is not a string, path or None.
    """
    if data_dir is None:
        env = os.environ.get(DATA_ENV_VAR, "")
        chosen: str | os.PathLike[str] = env if env else DEFAULT_DATA_DIR
    elif isinstance(data_dir, str | os.PathLike):
        chosen = data_dir
    else:
        raise TypeError(
            f"data_dir must be a str, os.PathLike or None, got {type(data_dir).__name__}"
        )
    return Path(chosen).expanduser()


def _describe_source(data_dir: str | os.PathLike[str] | None) -> str:
    if data_dir is not None:
        return "the data_dir argument"
    if os.environ.get(DATA_ENV_VAR, ""):
        return f"the {DATA_ENV_VAR} environment variable"
    return f"the default (neither data_dir nor {DATA_ENV_VAR} was set)"


def _not_found(
    name: str,
    root: Path,
    data_dir: str | os.PathLike[str] | None,
    reason: str,
) -> FileNotFoundError:
    target = root / name
    msg = (
        f"Required data file {name!r} was not found at {target} (data directory {root}, "
        f"taken from {_describe_source(data_dir)}). {reason} "
        f"Place the file at that path, or pass data_dir= / set the {DATA_ENV_VAR} environment "
        f"variable to a directory that contains {name!r}."
    )
    remote = _REMOTES.get(name)
    if remote is not None:
        msg += f" Upstream source: {remote.url}"
        if remote.member is not None:
            msg += f" (member {remote.member!r} of the archive)"
    return FileNotFoundError(2, msg, str(target))


def _urlopen(url: str) -> IO[bytes]:
    """Open ``url`` for reading; a separate function so tests can replace it."""
    return urllib.request.urlopen(url, timeout=60)


def _hash_file(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _verify(path: Path, remote: _Remote, name: str) -> None:
    """Raise :class:`ChecksumError` if ``path`` does not match ``remote``'s checksums."""
    if remote.sha256 is not None:
        got = _hash_file(path, "sha256")
        if got != remote.sha256:
            raise ChecksumError(
                f"Checksum mismatch for downloaded {name!r} (from {remote.url}): "
                f"expected sha256 {remote.sha256}, got {got}. The file was discarded."
            )
    if remote.git_blob_sha1 is not None:
        got = _git_blob_sha1(path)
        if got != remote.git_blob_sha1:
            raise ChecksumError(
                f"Checksum mismatch for downloaded {name!r} (from {remote.url}): "
                f"expected git blob sha1 {remote.git_blob_sha1}, got {got}. "
                "The file was discarded."
            )


def _atomic_write(
    dest: Path, write: Callable[[IO[bytes]], None], check: Callable[[Path], None]
) -> None:
    """Write to a temp file next to ``dest``, run ``check`` on it, then ``os.replace`` it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        check(tmp)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _download_url(url: str, dest: Path, check: Callable[[Path], None]) -> None:
    def write(f: IO[bytes]) -> None:
        with _urlopen(url) as response:
            shutil.copyfileobj(response, f, _CHUNK)

    _atomic_write(dest, write, check)


def _check_zip(path: Path) -> None:
    # No trustworthy checksum is known for the GroupLens archives: verify that the archive is a
    # readable zip whose members all pass their CRC-32 check instead.
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except zipfile.BadZipFile as exc:
        raise ChecksumError(f"Downloaded archive {path} is not a valid zip file: {exc}") from exc
    if bad is not None:
        raise ChecksumError(f"Downloaded archive {path} has a corrupt member {bad!r}")


def _download(name: str, remote: _Remote, root: Path) -> Path:
    dest = root / name
    if remote.member is None:
        _download_url(remote.url, dest, lambda p: _verify(p, remote, name))
        return dest
    if remote.archive_name is None:
        raise RuntimeError(f"internal error: archive member {name!r} has no archive_name")
    archive = root / remote.archive_name
    if not archive.is_file():
        _download_url(remote.url, archive, _check_zip)
    member = remote.member

    def extract(f: IO[bytes]) -> None:
        try:
            with zipfile.ZipFile(archive) as zf, zf.open(member) as src:
                shutil.copyfileobj(src, f, _CHUNK)
        except KeyError as exc:
            raise ChecksumError(
                f"Archive {archive} (from {remote.url}) has no member {member!r}"
            ) from exc
        except zipfile.BadZipFile as exc:
            raise ChecksumError(f"Archive {archive} is not a valid zip file: {exc}") from exc

    _atomic_write(dest, extract, lambda p: _verify(p, remote, name))
    return dest


def fetch(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    download: bool = True,
) -> Path:
    """Return the local path of a dataset file, downloading it if needed and allowed.

    Args:
        name: File name relative to the data directory, e.g.
            ``"mnist/train-images-idx3-ubyte.gz"`` or ``"movielens/ml-100k/u.data"``.
        data_dir: Data directory; see :func:`resolve_data_dir`.
        download: Whether to try downloading the file from its upstream source when it is not
            present locally. Only names listed by :func:`known_files` can be downloaded.

    Returns:
        Path of the existing (or freshly downloaded and verified) file.

    Raises:
        TypeError: If ``name`` is not a string.
        ValueError: If ``name`` is empty, absolute or escapes the data directory.
        FileNotFoundError: If the file is missing and cannot be downloaded (download disabled,
            no upstream source, or the download failed). The message names the file, the
            directory searched and how to provide the file.
        ChecksumError: If a downloaded file fails verification; nothing is left behind under
            the final file name.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    rel = Path(name)
    if not name or rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"name must be a relative path inside the data directory, got {name!r}")
    root = resolve_data_dir(data_dir)
    path = root / rel
    if path.is_file():
        return path
    remote = _REMOTES.get(name)
    if remote is None:
        raise _not_found(name, root, data_dir, "This file has no known download source.")
    if not download:
        raise _not_found(name, root, data_dir, "Downloading is disabled (download=False).")
    try:
        return _download(name, remote, root)
    except ChecksumError:
        raise
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise _not_found(
            name, root, data_dir, f"Downloading it from {remote.url} failed: {exc}."
        ) from exc
