"""Bad-input corpus of the data layer: every case is refused with a clear error or named.

Issue 15 ("Nothing silently wrong"), data part. Each case builds a data directory in tmp_path
from copies of the real files in shared/data (only the files it needs; skipped when shared/data
is absent) or from tiny synthetic files, and checks the outcome: a clear error naming the file,
its expected and actual size / checksum and what to do, or a warning naming what was used.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from datahelpers import REAL_DATA, write_mnist_dir

from dselectk_research.data import (
    VERIFY_ENV_VAR,
    ChecksumError,
    PartialDataWarning,
    _files,
    _integrity,
    fetch,
    fingerprint,
    load_mnist,
    load_movielens,
    load_multi_mnist,
    verified_files,
)

ML100K = ("movielens/ml-100k/u.data", "movielens/ml-100k/u.user", "movielens/ml-100k/u.item")
ML1M_PART = (
    "movielens/ml-1m/users.dat",
    "movielens/ml-1m/movies.dat",
    "movielens/ml-1m/ratings_users_0001-2999.dat",
)
UDATA_SHA = "06416e597f82b7342361e41163890c81036900f418ad91315590814211dca490"


@pytest.fixture(autouse=True)
def _fresh_memory_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with empty warning caches."""
    monkeypatch.setattr(_integrity, "_WARNED", set())
    monkeypatch.setattr(_integrity, "_ENV_WARNED", [])


def copy_real(root: Path, names: tuple[str, ...], rename: dict[str, str] | None = None) -> Path:
    """Copy shared/data files ``names`` into ``root`` (under ``rename[name]`` if given)."""
    if not REAL_DATA.is_dir():
        pytest.skip(f"real data not found at {REAL_DATA}")
    for name in names:
        dest = root / (rename or {}).get(name, name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REAL_DATA / name, dest)
    return root


def truncate_lines(path: Path, n_lines: int) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:n_lines]))


def truncate_mid_line(path: Path) -> None:
    data = path.read_bytes()
    cut = len(data) // 2
    while data[cut - 1 : cut] == b"\n":
        cut += 1
    path.write_bytes(data[:cut])


def edit_first_rating(path: Path) -> None:
    """Same size, one byte different: only the checksum can tell."""
    data = bytearray(path.read_bytes())
    first = data.index(b"\t", data.index(b"\t") + 1) + 1  # rating field of line 1
    data[first] = ord("1") if data[first] != ord("1") else ord("2")
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class Case:
    """One bad input: files to copy, how to damage them, the call, and what must happen."""

    id: str
    copy: tuple[str, ...]
    damage: Callable[[Path], None]
    call: Callable[[Path], object]
    outcome: str  # "error" (ChecksumError), "warn" (PartialDataWarning) or "ok" (silent)
    match: tuple[str, ...]
    rename: tuple[tuple[str, str], ...] = ()


def _ml100k(root: Path) -> object:
    return load_movielens(root, "ml-100k", download=False)


def _ml1m(source: str) -> Callable[[Path], object]:
    return lambda root: load_movielens(root, "ml-1m", ratings_source=source, download=False)


def _mnist_test(root: Path) -> object:
    return load_mnist(root, "mnist", "test", download=False)


_NO_DAMAGE: Callable[[Path], None] = lambda root: None  # noqa: E731
_UDATA = "movielens/ml-100k/u.data"
_FASHION_T10K = (
    "fashion-mnist/t10k-images-idx3-ubyte.gz",
    "fashion-mnist/t10k-labels-idx1-ubyte.gz",
)
_WHAT_TO_DO = ("Delete it", "data_dir=", "verify=False")

CASES = [
    Case(
        "u.data truncated at a line end",
        ML100K,
        lambda r: truncate_lines(r / _UDATA, 50_000),
        _ml100k,
        "error",
        (
            r"'movielens/ml-100k/u\.data'",
            "expected 1979173",
            "truncated",
            UDATA_SHA,
            *_WHAT_TO_DO,
        ),
    ),
    Case(
        "u.data truncated mid-line",
        ML100K,
        lambda r: truncate_mid_line(r / _UDATA),
        _ml100k,
        "error",
        (r"'movielens/ml-100k/u\.data'", "expected 1979173", UDATA_SHA, *_WHAT_TO_DO),
    ),
    Case(
        "u.data one rating edited, same size",
        ML100K,
        lambda r: edit_first_rating(r / _UDATA),
        _ml100k,
        "error",
        (
            r"'movielens/ml-100k/u\.data'",
            "size 1979173 bytes",
            f"expected {UDATA_SHA}",
            *_WHAT_TO_DO,
        ),
    ),
    Case(
        "u.data with an extra line",
        ML100K,
        lambda r: (r / _UDATA).write_bytes((r / _UDATA).read_bytes() + b"1\t2\t3\t881250949\n"),
        _ml100k,
        "error",
        (r"'movielens/ml-100k/u\.data'", r"expected 1979173 \(larger\)"),
    ),
    Case(
        "Fashion-MNIST files under mnist/",
        _FASHION_T10K,
        _NO_DAMAGE,
        _mnist_test,
        "error",
        (
            r"'mnist/t10k-images-idx3-ubyte\.gz'",
            "expected 1648877",
            r"content is that of 'fashion-mnist/t10k-images-idx3-ubyte\.gz'",
            "wrong folder",
            *_WHAT_TO_DO,
        ),
        rename=tuple((n, n.replace("fashion-mnist/", "mnist/")) for n in _FASHION_T10K),
    ),
    Case(
        "ML-1M users.dat truncated",
        ML1M_PART,
        lambda r: truncate_lines(r / "movielens/ml-1m/users.dat", 3000),
        _ml1m("users-0001-2999"),
        "error",
        (r"'movielens/ml-1m/users\.dat'", "expected 134368"),
    ),
    Case(
        "partial ML-1M form truncated",
        ML1M_PART,
        lambda r: truncate_lines(r / ML1M_PART[2], 1000),
        _ml1m("users-0001-2999"),
        "error",
        (r"'movielens/ml-1m/ratings_users_0001-2999\.dat'", "expected 11908773"),
    ),
    Case(
        "partial ML-1M without opt-in",
        ML1M_PART,
        _NO_DAMAGE,
        _ml1m("auto"),
        "warn",
        ("partial form 'users-0001-2999'", "2,999 users", "487,650 ratings", "ratings_source="),
    ),
    Case("partial ML-1M with opt-in", ML1M_PART, _NO_DAMAGE, _ml1m("users-0001-2999"), "ok", ()),
    Case("ML-100K intact", ML100K, _NO_DAMAGE, _ml100k, "ok", ()),
]


@pytest.mark.data
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_corpus(tmp_path: Path, case: Case) -> None:
    root = copy_real(tmp_path / "data", case.copy, dict(case.rename))
    case.damage(root)
    if case.outcome == "error":
        with pytest.raises(ChecksumError) as info:
            case.call(root)
        msg = str(info.value)
        assert isinstance(info.value, ValueError)
        for pattern in case.match:
            assert re.search(pattern, msg), (pattern, msg)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        case.call(root)
    if case.outcome == "ok":
        assert [str(w.message) for w in caught] == []
        return
    partial = [str(w.message) for w in caught if issubclass(w.category, PartialDataWarning)]
    assert len(partial) == 1, [str(w.message) for w in caught]
    for pattern in case.match:
        assert pattern in partial[0], (pattern, partial[0])


def test_partial_no_timestamps_without_opt_in_warns(tmp_path: Path) -> None:
    from datahelpers import write_ml1m

    d, _ = write_ml1m(tmp_path)
    (d / "ratings.dat").unlink()
    with pytest.warns(PartialDataWarning, match=r"'no-timestamps'.*7 users.*1 movies without"):
        load_movielens(tmp_path, "ml-1m", download=False, verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d2 = load_movielens(
            tmp_path, "ml-1m", ratings_source="no-timestamps", download=False, verify=False
        )
    assert d2.ratings_source == "no-timestamps"


# ---------------------------------------------------------------- the real data passes


@pytest.mark.data
def test_every_shared_file_is_known_and_passes(real_data: Path) -> None:
    names = sorted(
        p.relative_to(real_data).as_posix()
        for p in real_data.rglob("*")
        if p.is_file() and p.name != "PROVENANCE.md" and not p.name.startswith(".")
    )
    assert set(names) <= set(verified_files())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unknown-file warning either
        for name in names:
            assert fetch(name, real_data, download=False) == real_data / name


# ---------------------------------------------------------------- unknown files


def test_unknown_file_warns_once(tmp_path: Path) -> None:
    f = tmp_path / "movielens" / "ml-1m" / "my_ratings.dat"
    f.parent.mkdir(parents=True)
    f.write_text("1::10::5::0\n")
    with pytest.warns(UserWarning, match=r"'movielens/ml-1m/my_ratings\.dat'.*not in"):
        assert fetch("movielens/ml-1m/my_ratings.dat", tmp_path, download=False) == f
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fetch("movielens/ml-1m/my_ratings.dat", tmp_path, download=False)  # said once


@pytest.mark.data
def test_loader_with_unknown_file_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy_real(tmp_path, ML100K)
    monkeypatch.delitem(_files._REMOTES, "movielens/ml-100k/u.user")  # a form it does not know
    with pytest.warns(UserWarning, match=r"u\.user.*not in dselectk's registry") as rec:
        load_movielens(root, download=False)
    assert len([w for w in rec if "registry" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_movielens(root, download=False)


# ---------------------------------------------------------------- the verification cache


@pytest.fixture
def count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = _integrity._digest_file

    def counting(path: Path, algorithms: object) -> dict[str, str]:
        calls.append(Path(path))
        return real(path, algorithms)  # type: ignore[arg-type]

    monkeypatch.setattr(_integrity, "_digest_file", counting)
    return calls


@pytest.mark.data
def test_every_load_hashes_the_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count_hashing: list[Path]
) -> None:
    root = copy_real(tmp_path, ML100K)
    a = load_movielens(root, download=False)
    first = sorted(p.name for p in count_hashing)
    assert sorted(set(first)) == ["u.data", "u.item", "u.user"]
    assert not (root / ".dselectk-verified.json").exists()  # no cache keyed by timestamps
    b = load_movielens(root, download=False)  # hashed again: the content is the identity
    assert sorted(p.name for p in count_hashing[len(first) :]) == first
    assert a.fingerprint == b.fingerprint
    # an edit of the same size, its timestamp put back, is refused all the same
    udata = root / _UDATA
    st = udata.stat()
    data = bytearray(udata.read_bytes())
    data[10] = ord("7") if data[10] != ord("7") else ord("8")
    udata.write_bytes(bytes(data))
    os.utime(udata, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert udata.stat().st_size == st.st_size and udata.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(ChecksumError, match=r"u\.data"):
        load_movielens(root, download=False)


@pytest.mark.data
def test_read_only_data_dir_still_works(tmp_path: Path, count_hashing: list[Path]) -> None:
    root = copy_real(tmp_path / "ro", ML100K)
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
    for d in dirs:
        d.chmod(0o555)
    try:
        a = load_movielens(root, download=False)
        b = load_movielens(root, download=False)
        assert a.fingerprint == b.fingerprint and count_hashing

        assert sorted(p.name for p in root.iterdir()) == ["movielens"]  # nothing written
    finally:
        for d in dirs:
            d.chmod(0o755)


def test_fingerprint_writes_nothing(tmp_path: Path) -> None:
    write_mnist_dir(tmp_path, "mnist", *_tiny_mnist())
    path = tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert len(fingerprint([path])) == 16
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_verification_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_mnist_dir(tmp_path, "mnist", *_tiny_mnist())
    with pytest.raises(ChecksumError, match=r"mnist/t10k-images-idx3-ubyte\.gz"):
        load_mnist(tmp_path, "mnist", "test", download=False)
    x, _ = load_mnist(tmp_path, "mnist", "test", download=False, verify=False)
    assert x.shape == (6, 28, 28)
    monkeypatch.setenv(VERIFY_ENV_VAR, "0")
    with pytest.warns(UserWarning, match=f"disabled by {VERIFY_ENV_VAR}=0"):
        load_mnist(tmp_path, "mnist", "test", download=False)


# ---------------------------------------------------------------- fingerprints


def _tiny_mnist(
    seed: int = 0,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    imgs = rng.integers(0, 255, (8, 28, 28)).astype(np.uint8)
    lbls = rng.integers(0, 10, 8).astype(np.uint8)
    return (imgs, lbls), (imgs[:6], lbls[:6])


def test_fingerprint_is_stable_and_content_based(tmp_path: Path) -> None:
    a = write_mnist_dir(tmp_path / "a", "mnist", *_tiny_mnist())
    b = write_mnist_dir(tmp_path / "b", "mnist", *_tiny_mnist())
    files_a = sorted((a / "mnist").iterdir())
    files_b = sorted((b / "mnist").iterdir())
    fa = fingerprint(files_a)
    assert len(fa) == 16 and int(fa, 16) >= 0
    assert fingerprint(files_b) == fa  # another folder, same data
    assert fingerprint(reversed(files_a)) == fa  # order does not matter
    assert fingerprint(files_a[:3]) != fa
    write_mnist_dir(tmp_path / "b", "mnist", *_tiny_mnist(seed=1))
    assert fingerprint(files_b) != fa
    with pytest.raises(ValueError, match="at least one"):
        fingerprint([])
    with pytest.raises(FileNotFoundError, match="nope"):
        fingerprint([tmp_path / "nope"])


def test_loaders_report_the_fingerprint_of_their_files(tmp_path: Path) -> None:
    from datahelpers import write_ml100k

    write_ml100k(tmp_path)
    d = load_movielens(tmp_path, download=False, verify=False)
    assert [Path(f).name for f in d.files] == ["u.data", "u.user", "u.item"]
    assert d.fingerprint == fingerprint(d.files)
    write_mnist_dir(tmp_path, "mnist", *_tiny_mnist())
    kw = dict(n_train=20, n_val=4, n_test=6, download=False, verify=False)
    m = load_multi_mnist(tmp_path, **kw)  # type: ignore[arg-type]
    assert m.fingerprint == fingerprint(sorted((tmp_path / "mnist").iterdir()))


def test_multi_mnist_cache_of_other_sources_is_rebuilt(tmp_path: Path) -> None:
    kw = dict(n_train=20, n_val=4, n_test=6, download=False, verify=False, cache=True)
    write_mnist_dir(tmp_path, "mnist", *_tiny_mnist(seed=0))
    old = load_multi_mnist(tmp_path, **kw)  # type: ignore[arg-type]
    write_mnist_dir(tmp_path, "mnist", *_tiny_mnist(seed=1))  # sources replaced
    new = load_multi_mnist(tmp_path, **kw)  # type: ignore[arg-type]
    fresh = load_multi_mnist(tmp_path, **{**kw, "cache": False})  # type: ignore[arg-type]
    assert new.fingerprint != old.fingerprint and new.fingerprint == fresh.fingerprint
    assert torch.equal(new.train.X, fresh.train.X) and not torch.equal(new.train.X, old.train.X)
    assert len(list((tmp_path / "multi-mnist").glob("*.npz"))) == 1


# ---------------------------------------------------------------- cached archives, failed fetches


@pytest.fixture
def zipped_udata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, bytes]:
    """u.data served from a local zip archive; returns (upstream archive, member bytes)."""
    data = b"1\t2\t3\t4\n"
    archive = tmp_path / "up" / "ml-100k.zip"
    archive.parent.mkdir()
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("ml-100k/u.data", data)
    remote = _files._Remote(
        archive.as_uri(),
        sha256=hashlib.sha256(data).hexdigest(),
        member="ml-100k/u.data",
        archive_name="movielens/ml-100k.zip",
    )
    monkeypatch.setitem(_files._REMOTES, _UDATA, remote)
    return archive, data


def _bad_zip(path: Path) -> None:
    path.write_bytes(b"PK\x03\x04 cut short")


def _other_version_zip(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("ml-100k/u.data", b"9\t9\t9\t9\n")


def _truncated_zip(path: Path) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("ml-100k/u.data", os.urandom(4096))
    raw = path.read_bytes()
    path.write_bytes(raw[:100] + b"\x00" * 200 + raw[300:])  # member data damaged


@pytest.mark.parametrize("make_bad", [_bad_zip, _other_version_zip, _truncated_zip])
def test_bad_cached_archive_is_replaced(
    tmp_path: Path, zipped_udata: tuple[Path, bytes], make_bad: Callable[[Path], None]
) -> None:
    _, data = zipped_udata
    cache = tmp_path / "cache"
    cached = cache / "movielens" / "ml-100k.zip"
    cached.parent.mkdir(parents=True)
    make_bad(cached)
    assert fetch(_UDATA, cache).read_bytes() == data
    with zipfile.ZipFile(cached) as zf:  # the good archive replaced the bad one
        assert zf.read("ml-100k/u.data") == data


@pytest.mark.parametrize("make_bad", [_bad_zip, _other_version_zip])
def test_bad_cached_archive_offline_is_named_and_removed(
    tmp_path: Path, zipped_udata: tuple[Path, bytes], make_bad: Callable[[Path], None]
) -> None:
    upstream, _ = zipped_udata
    upstream.unlink()  # offline
    cache = tmp_path / "cache"
    cached = cache / "movielens" / "ml-100k.zip"
    cached.parent.mkdir(parents=True)
    make_bad(cached)
    with pytest.raises(FileNotFoundError) as info:
        fetch(_UDATA, cache)
    msg = str(info.value)
    assert str(cached) in msg and "removed" in msg and _UDATA in msg
    assert not cached.exists()
    assert not (cache / _UDATA).exists()


def _dirs(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_dir())


@pytest.mark.parametrize("name", ["mnist/t10k-labels-idx1-ubyte.gz", _UDATA])
def test_failed_fetch_leaves_no_empty_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    missing = (tmp_path / "nowhere.zip").as_uri()
    old = _files._REMOTES[name]
    monkeypatch.setitem(
        _files._REMOTES, name, _files._Remote(missing, "0" * 64, None, old.member, old.archive_name)
    )
    with pytest.raises(FileNotFoundError, match="failed"):
        fetch(name, tmp_path / "new-cache")
    assert not (tmp_path / "new-cache").exists()
    existing = tmp_path / "old-cache"
    (existing / "other").mkdir(parents=True)
    with pytest.raises(FileNotFoundError):
        fetch(name, existing)
    assert _dirs(existing) == ["other"]  # folders that were there stay


def test_downloaded_file_is_verified_once_then_read_on_each_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count_hashing: list[Path]
) -> None:
    payload = b"abc" * 100
    src = tmp_path / "up.bin"
    src.write_bytes(payload)
    name = "mnist/t10k-labels-idx1-ubyte.gz"
    sha = hashlib.sha256(payload).hexdigest()
    monkeypatch.setitem(_files._REMOTES, name, _files._Remote(src.as_uri(), sha256=sha))
    path = fetch(name, tmp_path / "c")
    assert count_hashing == []  # verified while downloading
    assert fetch(name, tmp_path / "c") == path
    assert count_hashing == [path]  # a later use reads its content again
    assert fingerprint([path]) == fingerprint([src.rename(tmp_path / path.name)])
