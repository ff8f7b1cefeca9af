"""Tests for data-directory resolution, fetch and checksummed downloads."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from dselectk_research.data import (
    DATA_ENV_VAR,
    ChecksumError,
    _files,
    fetch,
    known_files,
    resolve_data_dir,
)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _leftovers(directory: Path) -> list[str]:
    if not directory.exists():
        return []
    return sorted(p.name for p in directory.rglob("*") if p.is_file())


# ---------------------------------------------------------------- resolve_data_dir


def test_resolve_explicit_beats_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_ENV_VAR, str(tmp_path / "env"))
    assert resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_data_dir(str(tmp_path / "arg")) == tmp_path / "arg"


def test_resolve_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_ENV_VAR, str(tmp_path / "env"))
    assert resolve_data_dir() == tmp_path / "env"


def test_resolve_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(DATA_ENV_VAR, "")  # empty counts as unset
    assert resolve_data_dir() == tmp_path / ".cache" / "dselectk"


def test_resolve_type_error() -> None:
    with pytest.raises(TypeError, match="data_dir"):
        resolve_data_dir(3)  # type: ignore[arg-type]


def test_fetch_env_var_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz"
    f.parent.mkdir()
    f.write_bytes(b"x")
    monkeypatch.setenv(DATA_ENV_VAR, str(tmp_path))
    assert fetch("mnist/t10k-labels-idx1-ubyte.gz", verify=False) == f


# ---------------------------------------------------------------- fetch: local and errors


def test_fetch_existing_file_not_verified(tmp_path: Path) -> None:
    # With verify=False local files are used as they are (the user may provide their own copy);
    # by default they are verified (tests/data/test_bad_inputs.py).
    f = tmp_path / "movielens" / "ml-100k" / "u.data"
    f.parent.mkdir(parents=True)
    f.write_text("1\t1\t5\t0\n")
    assert fetch("movielens/ml-100k/u.data", tmp_path, download=False, verify=False) == f


def test_missing_file_message(tmp_path: Path) -> None:
    name = "mnist/train-images-idx3-ubyte.gz"
    with pytest.raises(FileNotFoundError) as info:
        fetch(name, tmp_path, download=False)
    msg = str(info.value)
    assert name in msg
    assert str(tmp_path) in msg
    assert DATA_ENV_VAR in msg
    assert "download=False" in msg
    assert "ossci-datasets" in msg  # where it would come from


def test_missing_file_message_env_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"taken from the {DATA_ENV_VAR}"):
        fetch("mnist/train-images-idx3-ubyte.gz", download=False)


def test_unknown_name_has_no_source(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no known download source") as info:
        fetch("movielens/ml-1m/ratings_no_timestamps.csv.gz", tmp_path)
    assert "ratings_no_timestamps.csv.gz" in str(info.value)


@pytest.mark.parametrize("bad", ["", "/etc/passwd", "../x", "a/../../b"])
def test_fetch_rejects_bad_names(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="relative path"):
        fetch(bad, tmp_path)


def test_known_files_cover_loaders() -> None:
    names = known_files()
    assert "mnist/train-images-idx3-ubyte.gz" in names
    assert "fashion-mnist/t10k-labels-idx1-ubyte.gz" in names
    assert "movielens/ml-100k/u.item" in names
    assert "movielens/ml-1m/ratings.dat" in names
    for name in names:
        remote = _files._REMOTES[name]
        assert remote.sha256 or remote.git_blob_sha1  # every download is verified


# ---------------------------------------------------------------- downloads (no network)


@pytest.fixture
def remote_file(tmp_path: Path) -> tuple[Path, bytes]:
    src = tmp_path / "upstream" / "file.bin"
    src.parent.mkdir()
    payload = b"hello dselect-k\n" * 1000
    src.write_bytes(payload)
    return src, payload


def test_download_ok(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remote_file: tuple[Path, bytes]
) -> None:
    src, payload = remote_file
    name = "mnist/t10k-labels-idx1-ubyte.gz"
    remote = _files._Remote(src.as_uri(), sha256=_sha256(payload))
    monkeypatch.setitem(_files._REMOTES, name, remote)
    cache = tmp_path / "cache"
    path = fetch(name, cache)
    assert path == cache / name
    assert path.read_bytes() == payload
    assert _leftovers(cache) == ["t10k-labels-idx1-ubyte.gz"]
    # Second call uses the local copy (upstream removed).
    src.unlink()
    assert fetch(name, cache) == path


def test_download_checksum_mismatch_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remote_file: tuple[Path, bytes]
) -> None:
    src, _ = remote_file
    name = "mnist/t10k-labels-idx1-ubyte.gz"
    monkeypatch.setitem(_files._REMOTES, name, _files._Remote(src.as_uri(), sha256="0" * 64))
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match="expected sha256 0000") as info:
        fetch(name, cache)
    assert name in str(info.value)
    assert isinstance(info.value, ValueError)
    assert not (cache / name).exists()
    assert _leftovers(cache) == []  # no half-written temp file either


def test_download_failure_is_file_not_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "mnist/t10k-labels-idx1-ubyte.gz"
    missing = (tmp_path / "nope.gz").as_uri()
    monkeypatch.setitem(_files._REMOTES, name, _files._Remote(missing, sha256="0" * 64))
    with pytest.raises(FileNotFoundError, match="failed") as info:
        fetch(name, tmp_path / "cache")
    assert name in str(info.value)
    assert _leftovers(tmp_path / "cache") == []


def test_download_interrupted_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken:
        def __enter__(self) -> Broken:
            return self

        def __exit__(self, *args: object) -> None:
            return None

        def read(self, n: int = -1) -> bytes:
            raise ConnectionResetError("connection reset mid-transfer")

    monkeypatch.setattr(_files, "_urlopen", lambda url: Broken())
    name = "mnist/t10k-labels-idx1-ubyte.gz"
    with pytest.raises(FileNotFoundError, match="connection reset"):
        fetch(name, tmp_path)
    assert _leftovers(tmp_path) == []


def _make_zip(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in members.items():
            zf.writestr(member, data)
    return path


def test_download_zip_member(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    udata = b"1\t2\t3\t4\n"
    uitem = b"item\n"
    archive = _make_zip(
        tmp_path / "up" / "ml-100k.zip", {"ml-100k/u.data": udata, "ml-100k/u.item": uitem}
    )
    for name, member, data in (
        ("movielens/ml-100k/u.data", "ml-100k/u.data", udata),
        ("movielens/ml-100k/u.item", "ml-100k/u.item", uitem),
    ):
        monkeypatch.setitem(
            _files._REMOTES,
            name,
            _files._Remote(
                archive.as_uri(),
                sha256=_sha256(data),
                member=member,
                archive_name="movielens/ml-100k.zip",
            ),
        )
    cache = tmp_path / "cache"
    assert fetch("movielens/ml-100k/u.data", cache).read_bytes() == udata
    archive.unlink()  # second member comes from the cached archive
    assert fetch("movielens/ml-100k/u.item", cache).read_bytes() == uitem


def test_download_zip_member_git_blob_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"1::2::3::4\n"
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    archive = _make_zip(tmp_path / "up" / "ml-1m.zip", {"ml-1m/ratings.dat": data})
    name = "movielens/ml-1m/ratings.dat"
    good = _files._Remote(
        archive.as_uri(),
        git_blob_sha1=blob,
        member="ml-1m/ratings.dat",
        archive_name="movielens/ml-1m.zip",
    )
    monkeypatch.setitem(_files._REMOTES, name, good)
    assert fetch(name, tmp_path / "a").read_bytes() == data
    bad = _files._Remote(
        archive.as_uri(),
        git_blob_sha1="f" * 40,
        member="ml-1m/ratings.dat",
        archive_name="movielens/ml-1m.zip",
    )
    monkeypatch.setitem(_files._REMOTES, name, bad)
    with pytest.raises(ChecksumError, match="git blob"):
        fetch(name, tmp_path / "b")
    assert not (tmp_path / "b" / name).exists()
    assert [p for p in _leftovers(tmp_path / "b") if p != "ml-1m.zip"] == []


def test_download_corrupt_zip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bogus = tmp_path / "up" / "ml-100k.zip"
    bogus.parent.mkdir()
    bogus.write_bytes(b"this is not a zip file")
    name = "movielens/ml-100k/u.data"
    monkeypatch.setitem(
        _files._REMOTES,
        name,
        _files._Remote(
            bogus.as_uri(),
            sha256="0" * 64,
            member="ml-100k/u.data",
            archive_name="movielens/ml-100k.zip",
        ),
    )
    with pytest.raises(ChecksumError, match="not a valid zip"):
        fetch(name, tmp_path / "cache")
    assert _leftovers(tmp_path / "cache") == []


@pytest.mark.data
def test_real_data_via_env_var(real_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # shared/data uses the layout fetch expects, so pointing DSELECTK_DATA at it just works.
    monkeypatch.setenv(DATA_ENV_VAR, str(real_data))
    for name in ("mnist/t10k-labels-idx1-ubyte.gz", "movielens/ml-100k/u.item"):
        path = fetch(name, download=False)
        assert path == real_data / name
        # The shared copies are the official bytes: they match the recorded checksums.
        assert _files._hash_file(path, "sha256") == _files._REMOTES[name].sha256
