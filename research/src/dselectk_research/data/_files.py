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
file under the final name, nor the folders it created. Synthetic data is never substituted for a
missing file.

Local files are verified too: :func:`fetch` checks every file the registry knows (the
downloadable files of :func:`known_files` and the local-only files of ``shared/data``, e.g. the
partial ML-1M forms, all with the checksums of ``shared/data/PROVENANCE.md``) against its size
and checksum on every use (its content read and hashed, never trusted from its size and
timestamp, see :mod:`dselectk_research.data._integrity`). Files it does not know are used
with one warning.

A cached GroupLens archive that is corrupt, or whose member fails its checksum, is removed and
downloaded again (when downloading is allowed); errors about it name it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from dselectk_research.data import _integrity
from dselectk_research.data._integrity import ChecksumError, Expected

__all__ = [
    "DATA_ENV_VAR",
    "DEFAULT_DATA_DIR",
    "ChecksumError",
    "fetch",
    "known_files",
    "resolve_data_dir",
    "verified_files",
]

DATA_ENV_VAR = "DSELECTK_DATA"
"""Environment variable naming the data directory."""

DEFAULT_DATA_DIR = Path("~/.cache/dselectk")
"""Data directory used when neither the argument nor the environment variable is set."""

_CHUNK = 1 << 20


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
        size: Expected size in bytes, if known (checked on local files).
    """

    url: str
    sha256: str | None = None
    git_blob_sha1: str | None = None
    member: str | None = None
    archive_name: str | None = None
    size: int | None = None


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
        size=9912422,
    ),
    "mnist/train-labels-idx1-ubyte.gz": _Remote(
        _MNIST_URL + "train-labels-idx1-ubyte.gz",
        sha256="3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
        size=28881,
    ),
    "mnist/t10k-images-idx3-ubyte.gz": _Remote(
        _MNIST_URL + "t10k-images-idx3-ubyte.gz",
        sha256="8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
        size=1648877,
    ),
    "mnist/t10k-labels-idx1-ubyte.gz": _Remote(
        _MNIST_URL + "t10k-labels-idx1-ubyte.gz",
        sha256="f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
        size=4542,
    ),
    "fashion-mnist/train-images-idx3-ubyte.gz": _Remote(
        _FASHION_URL + "train-images-idx3-ubyte.gz",
        sha256="3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
        size=26421880,
    ),
    "fashion-mnist/train-labels-idx1-ubyte.gz": _Remote(
        _FASHION_URL + "train-labels-idx1-ubyte.gz",
        sha256="a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
        size=29515,
    ),
    "fashion-mnist/t10k-images-idx3-ubyte.gz": _Remote(
        _FASHION_URL + "t10k-images-idx3-ubyte.gz",
        sha256="346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
        size=4422102,
    ),
    "fashion-mnist/t10k-labels-idx1-ubyte.gz": _Remote(
        _FASHION_URL + "t10k-labels-idx1-ubyte.gz",
        sha256="67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
        size=5148,
    ),
    # MovieLens files are members of the GroupLens zip archives. We do not know a trustworthy
    # checksum of the archives themselves, so the archive is only checked for integrity (zip CRCs
    # via ZipFile.testzip); each extracted member is then verified against the SHA-256 recorded in
    # PROVENANCE.md. For ml-1m/ratings.dat only the git blob hash is published, so that is checked.
    "movielens/ml-100k/u.data": _Remote(
        _ML100K_URL,
        sha256="06416e597f82b7342361e41163890c81036900f418ad91315590814211dca490",
        size=1979173,
        member="ml-100k/u.data",
        archive_name="movielens/ml-100k.zip",
    ),
    "movielens/ml-100k/u.item": _Remote(
        _ML100K_URL,
        sha256="553841ebc7de3a0fd0d6b62a204ea30c1e651aacfb2814c7a6584ac52f2c5701",
        size=236344,
        member="ml-100k/u.item",
        archive_name="movielens/ml-100k.zip",
    ),
    "movielens/ml-100k/u.user": _Remote(
        _ML100K_URL,
        sha256="f120e114da2e8cf314fd28f99417c94ae9ddf1cb6db8ce0e4b5995d40e90e62c",
        size=22628,
        member="ml-100k/u.user",
        archive_name="movielens/ml-100k.zip",
    ),
    "movielens/ml-1m/movies.dat": _Remote(
        _ML1M_URL,
        sha256="0140fc2356357c1a851d0f52e893a1e4d3696df632c4141cea8d5bc3d621f0b9",
        size=171308,
        member="ml-1m/movies.dat",
        archive_name="movielens/ml-1m.zip",
    ),
    "movielens/ml-1m/users.dat": _Remote(
        _ML1M_URL,
        sha256="1dc3a95300cb19f7c10e027daf29b8cdf1d908dab65b5edfb45950aa389a10a3",
        size=134368,
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


# Files with known checksums but no download source: the other files of shared/data (all from
# shared/data/PROVENANCE.md), in particular the partial ML-1M forms, which are verified like the
# others (a truncated or edited partial form is refused, not used).
_LOCAL_ONLY: dict[str, Expected] = {
    "movielens/ml-100k/u.genre": Expected(
        "9757e0d3e6b298159a80dd48eaf938114690e911e39af97a76949ef1663610bb", size=202
    ),
    "movielens/ml-100k/u.occupation": Expected(
        "cd5fbec9afe345d993a62fc7817df1a4a9079c4feb267b3118763b8fd942137d", size=193
    ),
    "movielens/ml-100k/u.info": Expected(
        "5b0a40b2e47a729ee6203063f6dcf8790c2e63f5a18663e6ee318a72c5f3c27b", size=36
    ),
    "movielens/ml-100k/README": Expected(
        "4883b8cf340ed0059971b33f56ad3adc88a40792108ebca3d24aafc4c82e8b52", size=6750
    ),
    "movielens/ml-1m/README": Expected(
        "2d5ddce86ccbd247207456165827b4b9ddf27282bca93807d4c763e28414f133", size=5577
    ),
    "movielens/ml-1m/ratings_users_0001-2999.dat": Expected(
        "1273c4edfe3c0ff9e3a0a0d55819faeb947da0ad7df3927333b51ebefbeedc3d", size=11908773
    ),
    "movielens/ml-1m/ratings_no_timestamps.csv.gz": Expected(
        "634852a694f368e4cef9e62fc3dc35f294402226905fb87906c66aa8bb188424", size=4882033
    ),
    "movielens/ml-1m/item_index_to_movieid.csv": Expected(
        "3ff60bfc7470d8157e8de31af36a683b740e3036a0151229532a66bb040762b5", size=38794
    ),
}


def _expected(name: str) -> Expected | None:
    """What the registry knows about ``name`` (None for a file it does not know)."""
    remote = _REMOTES.get(name)
    if remote is not None:
        return Expected(remote.sha256, remote.git_blob_sha1, remote.size)
    return _LOCAL_ONLY.get(name)


def _known() -> dict[str, Expected]:
    table = {name: e for name in _REMOTES if (e := _expected(name)) is not None}
    return {**_LOCAL_ONLY, **table}


def verified_files() -> list[str]:
    """Names of every file whose local copy is verified (downloadable or not).

    Returns:
        Sorted list of file names relative to the data directory: :func:`known_files` plus the
        local-only files of ``shared/data`` (e.g. the partial ML-1M forms).
    """
    return sorted(_known())


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


def _missing_dirs(path: Path) -> list[Path]:
    """The folders above ``path`` that do not exist yet, deepest first."""
    missing = []
    for parent in path.parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


def _remove_dirs(dirs: list[Path]) -> None:
    """Remove the folders a failed fetch created, deepest first, if they are still empty."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            continue  # not empty (or not ours to remove): leave it


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


def _extract(name: str, remote: _Remote, archive: Path, dest: Path) -> None:
    """Extract ``remote.member`` of ``archive`` to ``dest`` and verify it; errors name both."""
    member = str(remote.member)

    def extract(f: IO[bytes]) -> None:
        try:
            with zipfile.ZipFile(archive) as zf, zf.open(member) as src:
                shutil.copyfileobj(src, f, _CHUNK)
        except KeyError as exc:
            raise ChecksumError(
                f"Archive {archive} (from {remote.url}) has no member {member!r}"
            ) from exc
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
            raise ChecksumError(f"Archive {archive} is not a valid zip file: {exc}") from exc

    def check(p: Path) -> None:
        try:
            _verify(p, remote, name)
        except ChecksumError as exc:
            raise ChecksumError(f"{exc} It was extracted from the archive {archive}.") from exc

    _atomic_write(dest, extract, check)


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
        try:
            _extract(name, remote, archive, dest)
        except ChecksumError as exc:
            archive.unlink(missing_ok=True)  # a bad download must not stay in the cache
            raise ChecksumError(f"{exc} The downloaded archive was removed.") from exc
        return dest
    try:
        _extract(name, remote, archive, dest)
        return dest
    except ChecksumError as exc:
        # A bad archive left in the cache (interrupted copy, disk error, other version): remove
        # it and download it again, rather than failing on it every time.
        archive.unlink(missing_ok=True)
        reason = f"The cached archive {archive} was bad and has been removed ({exc})."
    try:
        _download_url(remote.url, archive, _check_zip)
    except ChecksumError as exc:
        raise ChecksumError(f"{reason} Downloading it again gave a bad archive: {exc}") from exc
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise FileNotFoundError(
            2, f"{reason} Downloading it again from {remote.url} failed: {exc}", str(archive)
        ) from exc
    try:
        _extract(name, remote, archive, dest)
    except ChecksumError as exc:
        archive.unlink(missing_ok=True)
        raise ChecksumError(f"{reason} The new download is bad too: {exc}") from exc
    return dest


def fetch(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    download: bool = True,
    verify: bool | None = None,
) -> Path:
    """Return the local path of a verified dataset file, downloading it if needed and allowed.

    A local file the registry knows (:func:`verified_files`) is checked against its known size
    and checksum on every use (one read of its content; nothing is trusted from its size or
    timestamp). A local file the registry does not know is returned with a warning (once per
    file and process).

    Args:
        name: File name relative to the data directory, e.g.
            ``"mnist/train-images-idx3-ubyte.gz"`` or ``"movielens/ml-100k/u.data"``.
        data_dir: Data directory; see :func:`resolve_data_dir`.
        download: Whether to try downloading the file from its upstream source when it is not
            present locally. Only names listed by :func:`known_files` can be downloaded.
        verify: Whether to verify local files. None (the default) verifies unless the
            ``DSELECTK_VERIFY`` environment variable is ``0``/``false``/``no``/``off``; pass
            False to use your own copy of a known file as it is.

    Returns:
        Path of the existing (or freshly downloaded and verified) file.

    Raises:
        TypeError: If ``name`` is not a string.
        ValueError: If ``name`` is empty, absolute or escapes the data directory.
        FileNotFoundError: If the file is missing and cannot be downloaded (download disabled,
            no upstream source, or the download failed). The message names the file, the
            directory searched and how to provide the file.
        ChecksumError: If a local file is not the known file (the message names the file, its
            expected and actual size and checksum, and what to do), or a downloaded file fails
            verification; nothing is left behind under the final file name, and a cached
            archive that proves bad is removed.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    rel = Path(name)
    if not name or rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"name must be a relative path inside the data directory, got {name!r}")
    root = resolve_data_dir(data_dir)
    path = root / rel
    check = _integrity.verify_enabled(verify)
    if path.is_file():
        if check:
            _integrity.check_file(name, path, _expected(name), _known())
        return path
    remote = _REMOTES.get(name)
    if remote is None:
        raise _not_found(name, root, data_dir, "This file has no known download source.")
    if not download:
        raise _not_found(name, root, data_dir, "Downloading is disabled (download=False).")
    created = _missing_dirs(path)
    if remote.archive_name is not None:
        created += [d for d in _missing_dirs(root / remote.archive_name) if d not in created]
    created.sort(key=lambda d: len(d.parts), reverse=True)
    try:
        path = _download(name, remote, root)
    except ChecksumError:
        _remove_dirs(created)
        raise
    except (OSError, urllib.error.URLError, ValueError) as exc:
        _remove_dirs(created)
        raise _not_found(
            name, root, data_dir, f"Downloading it from {remote.url} failed: {exc}."
        ) from exc
    except BaseException:
        _remove_dirs(created)
        raise
    return path
