"""Tests for the IDX reader, MNIST loading and the Multi-MNIST construction."""

from __future__ import annotations

import gzip
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from datahelpers import idx_bytes, write_idx, write_mnist_dir

from dselectk_research.data import load_mnist, load_multi_mnist, make_multi_mnist, read_idx

# ---------------------------------------------------------------- read_idx


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize(
    "arr",
    [
        np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
        np.array([5, 0, 9], dtype=np.uint8),
        np.arange(-6, 6, dtype=">i4").reshape(3, 4),
        np.linspace(-1, 1, 10).astype(">f4"),
        np.array([[-3, 7]], dtype=">i2"),
    ],
)
def test_idx_roundtrip(tmp_path: Path, arr: np.ndarray, compress: bool) -> None:
    path = write_idx(tmp_path / "x.idx", arr, compress=compress)
    out = read_idx(path)
    assert out.shape == arr.shape
    assert out.dtype == arr.dtype.newbyteorder("=")
    np.testing.assert_array_equal(out, arr)


def test_idx_gzip_detected_by_content(tmp_path: Path) -> None:
    arr = np.ones((2, 2), dtype=np.uint8)
    path = tmp_path / "no_extension"
    path.write_bytes(gzip.compress(idx_bytes(arr)))
    np.testing.assert_array_equal(read_idx(path), arr)


def test_idx_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad.idx"
    path.write_bytes(b"\x01\x00\x08\x01" + b"\x00\x00\x00\x01" + b"\x05")
    with pytest.raises(ValueError, match="bad magic number") as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_idx_unknown_dtype_code(tmp_path: Path) -> None:
    path = tmp_path / "code.idx"
    path.write_bytes(b"\x00\x00\x07\x01" + b"\x00\x00\x00\x01" + b"\x05")
    with pytest.raises(ValueError, match="type code 0x07") as info:
        read_idx(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("compress", [True, False])
def test_idx_truncated_payload(tmp_path: Path, compress: bool) -> None:
    data = idx_bytes(np.zeros((3, 4, 4), dtype=np.uint8))[:-5]
    path = tmp_path / "trunc.idx"
    path.write_bytes(gzip.compress(data) if compress else data)
    with pytest.raises(ValueError, match="truncated") as info:
        read_idx(path)
    assert str(path) in str(info.value)
    assert "48" in str(info.value)  # expected payload bytes


def test_idx_truncated_header_and_trailing_bytes(tmp_path: Path) -> None:
    path = tmp_path / "h.idx"
    path.write_bytes(b"\x00\x00\x08\x03\x00\x00\x00\x02")
    with pytest.raises(ValueError, match="truncated"):
        read_idx(path)
    path.write_bytes(idx_bytes(np.zeros(3, dtype=np.uint8)) + b"\x00")
    with pytest.raises(ValueError, match="longer than its header"):
        read_idx(path)
    path.write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="too short"):
        read_idx(path)


def test_idx_truncated_gzip_stream(tmp_path: Path) -> None:
    blob = gzip.compress(idx_bytes(np.arange(1000, dtype=np.uint8)))
    path = tmp_path / "cut.gz"
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="gzip") as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_idx_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.idx"):
        read_idx(tmp_path / "nope.idx")


# ---------------------------------------------------------------- load_mnist


def _tiny_sources(
    n_train: int = 60, n_test: int = 30, seed: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Constant-valued images: train values 1..n_train, test values 101..100+n_test.

    An image's value identifies it, so the sources of every canvas can be read back.
    """
    assert n_train <= 100 and n_test <= 150
    rng = np.random.default_rng(seed)
    train_vals = np.arange(1, n_train + 1, dtype=np.uint8)
    test_vals = np.arange(101, 101 + n_test, dtype=np.uint8)
    train = (
        np.broadcast_to(train_vals[:, None, None], (n_train, 28, 28)).copy(),
        rng.integers(0, 10, n_train).astype(np.uint8),
    )
    test = (
        np.broadcast_to(test_vals[:, None, None], (n_test, 28, 28)).copy(),
        rng.integers(0, 10, n_test).astype(np.uint8),
    )
    return train, test


@pytest.mark.parametrize("kind", ["mnist", "fashion-mnist"])
def test_load_mnist_tiny(tmp_path: Path, kind: str) -> None:
    train, test = _tiny_sources()
    write_mnist_dir(tmp_path, kind, train, test)
    x, y = load_mnist(tmp_path, kind, "train", download=False, verify=False)
    assert x.shape == (60, 28, 28) and x.dtype == np.uint8
    assert y.shape == (60,) and y.dtype == np.int64
    np.testing.assert_array_equal(y, train[1])
    xt, _ = load_mnist(tmp_path, kind, "test", download=False, verify=False)
    assert xt.shape == (30, 28, 28)
    np.testing.assert_array_equal(xt, test[0])


def test_load_mnist_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind"):
        load_mnist(tmp_path, "kmnist")
    with pytest.raises(ValueError, match="split"):
        load_mnist(tmp_path, "mnist", "val")
    with pytest.raises(FileNotFoundError, match=r"mnist/train-images-idx3-ubyte\.gz"):
        load_mnist(tmp_path, "mnist", "train", download=False, verify=False)
    train, test = _tiny_sources()
    write_mnist_dir(tmp_path, "mnist", (train[0], train[1][:-1]), test)
    with pytest.raises(ValueError, match=r"60 images but .* 59 labels"):
        load_mnist(tmp_path, "mnist", "train", download=False, verify=False)
    write_idx(tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz", np.zeros((3, 5), np.uint8))
    with pytest.raises(ValueError, match=r"\(N, 28, 28\)"):
        load_mnist(tmp_path, "mnist", "test", download=False, verify=False)


# ---------------------------------------------------------------- make_multi_mnist


def _expected_canvas(a: np.ndarray, b: np.ndarray, shift: int = 4) -> np.ndarray:
    h, w = a.shape
    d = 2 * shift
    top_left = np.zeros((h + d, w + d), a.dtype)
    bottom_right = np.zeros((h + d, w + d), a.dtype)
    top_left[:h, :w] = a
    bottom_right[d:, d:] = b
    return np.maximum(top_left, bottom_right)


def test_multi_mnist_placement_pixelwise() -> None:
    rng = np.random.default_rng(1)
    m = 12
    images = rng.integers(0, 256, (m, 28, 28)).astype(np.uint8)
    labels = np.arange(m)  # label == source index, so the sources can be recovered
    x, y1, y2 = make_multi_mnist(images, labels, 50, seed=3)
    assert x.shape == (50, 36, 36) and x.dtype == np.uint8
    assert y1.dtype == np.int64 and y2.dtype == np.int64
    assert np.all(y1 != y2)  # two distinct images per example
    for k in range(50):
        np.testing.assert_array_equal(x[k], _expected_canvas(images[y1[k]], images[y2[k]]))


def test_multi_mnist_top_left_is_task1() -> None:
    # Image 0: a single bright pixel at its top-left corner; image 1: at its bottom-right.
    a = np.zeros((28, 28), np.uint8)
    a[0, 0] = 200
    b = np.zeros((28, 28), np.uint8)
    b[27, 27] = 100
    x, y1, y2 = make_multi_mnist(np.stack([a, b]), np.array([3, 7]), 20, seed=0)
    for k in range(20):
        nz = set(zip(*np.nonzero(x[k]), strict=True))
        if y1[k] == 3:  # a shifted up-left -> (0, 0); b shifted down-right -> (35, 35)
            assert y2[k] == 7 and nz == {(0, 0), (35, 35)}
        else:  # b top-left -> (27, 27); a bottom-right -> (8, 8)
            assert (y1[k], y2[k]) == (7, 3) and nz == {(27, 27), (8, 8)}
    assert {int(v) for v in y1} == {3, 7}  # both orders occur


def test_multi_mnist_deterministic() -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 28, 28)).astype(np.uint8)
    labels = rng.integers(0, 10, 40)
    a = make_multi_mnist(images, labels, 30, seed=5)
    b = make_multi_mnist(images, labels, 30, seed=5)
    c = make_multi_mnist(images, labels, 30, seed=6)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)
    assert not np.array_equal(a[0], c[0])


def test_multi_mnist_shift_and_validation() -> None:
    images = np.ones((3, 5, 5), np.uint8)
    x, _, _ = make_multi_mnist(images, np.arange(3), 4, seed=0, shift=2)
    assert x.shape == (4, 9, 9)
    with pytest.raises(ValueError, match="at least 2"):
        make_multi_mnist(images[:1], np.arange(1), 4)
    with pytest.raises(ValueError, match="labels must have shape"):
        make_multi_mnist(images, np.arange(2), 4)
    with pytest.raises(ValueError, match="images must have shape"):
        make_multi_mnist(images[0], np.arange(5), 4)
    with pytest.raises(ValueError, match="n must be >= 0"):
        make_multi_mnist(images, np.arange(3), -1)
    with pytest.raises(TypeError, match="n must be an int"):
        make_multi_mnist(images, np.arange(3), 2.0)  # type: ignore[arg-type]


def _python_calls(fn: Callable[[], object]) -> int:
    """Python-level function calls made while running ``fn`` (a count of work, not of time)."""
    calls = 0

    def prof(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_multi_mnist_is_vectorised() -> None:
    """The construction has no per-example Python loop: the Python work does not grow with the
    number of examples (a bound on work instead of a wall-clock bound, which fails under load)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (60_000, 28, 28)).astype(np.uint8)
    labels = rng.integers(0, 10, 60_000)
    small = _python_calls(lambda: make_multi_mnist(images, labels, 1_000, seed=0))
    large = _python_calls(lambda: make_multi_mnist(images, labels, 100_000, seed=0))
    assert large <= small + 10, (small, large)
    x, _, _ = make_multi_mnist(images, labels, 100_000, seed=0)
    assert x.shape == (100_000, 36, 36)


# ---------------------------------------------------------------- load_multi_mnist


def _source_values(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Identity (constant value) of the top-left and bottom-right source of each canvas."""
    raw = np.rint(x[:, 0].numpy() * 255).astype(np.int64)
    return raw[:, 0, 0], raw[:, 35, 35]


def test_load_multi_mnist_no_leakage(tmp_path: Path) -> None:
    train, test = _tiny_sources(60, 30)
    write_mnist_dir(tmp_path, "mnist", train, test)
    d = load_multi_mnist(
        tmp_path, n_train=400, n_val=80, n_test=90, seed=1, download=False, verify=False
    )
    for split, n in ((d.train, 400), (d.val, 80), (d.test, 90)):
        assert split.X.shape == (n, 1, 36, 36) and split.X.dtype == torch.float32
        assert split.y1.shape == (n,) and split.y1.dtype == torch.int64
        assert split.y2.dtype == torch.int64
        assert float(split.X.min()) >= 0.0 and float(split.X.max()) <= 1.0
        assert len(split) == n and len(split.dataset()) == n
    tr = set(np.concatenate(_source_values(d.train.X)).tolist())
    va = set(np.concatenate(_source_values(d.val.X)).tolist())
    te = set(np.concatenate(_source_values(d.test.X)).tolist())
    assert tr <= set(range(1, 61)) and va <= set(range(1, 61))
    assert te <= set(range(101, 131))  # test canvases use official test images only
    assert not tr & va  # train and val use disjoint source images
    assert len(va) <= 12  # default val pool: n_val / (n_train + n_val) = 1/6 of 60 images
    # Labels follow the sources: the label of the top-left / bottom-right image.
    tl, br = _source_values(d.test.X)
    np.testing.assert_array_equal(d.test.y1.numpy(), test[1][tl - 101])
    np.testing.assert_array_equal(d.test.y2.numpy(), test[1][br - 101])
    tl, br = _source_values(d.train.X)
    np.testing.assert_array_equal(d.train.y1.numpy(), train[1][tl - 1])
    np.testing.assert_array_equal(d.train.y2.numpy(), train[1][br - 1])


def test_load_multi_mnist_deterministic_and_cached(tmp_path: Path) -> None:
    train, test = _tiny_sources(40, 20)
    write_mnist_dir(tmp_path, "fashion-mnist", train, test)
    kw = dict(kind="fashion-mnist", n_train=50, n_val=10, n_test=10, download=False, verify=False)
    a = load_multi_mnist(tmp_path, seed=2, **kw)  # type: ignore[arg-type]
    b = load_multi_mnist(tmp_path, seed=2, cache=True, **kw)  # type: ignore[arg-type]
    cached = list((tmp_path / "multi-fashion-mnist").glob("*.npz"))
    assert len(cached) == 1
    # The atomic write (dselectk.io.save_npz) leaves no temp file beside the cache.
    assert not [p for p in cached[0].parent.iterdir() if p.suffix in (".part", ".tmp")]
    assert [p.name for p in cached[0].parent.iterdir()] == [cached[0].name]
    # Remove the sources: a cached call must not need them.
    for f in (tmp_path / "fashion-mnist").iterdir():
        f.unlink()
    c = load_multi_mnist(tmp_path, seed=2, cache=True, **kw)  # type: ignore[arg-type]
    for s in ("train", "val", "test"):
        for field in ("X", "y1", "y2"):
            ta = getattr(getattr(a, s), field)
            assert torch.equal(ta, getattr(getattr(b, s), field))
            assert torch.equal(ta, getattr(getattr(c, s), field))
    assert c.kind == "fashion-mnist"


def test_load_multi_mnist_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind"):
        load_multi_mnist(tmp_path, kind="emnist")
    with pytest.raises(ValueError, match="n_train"):
        load_multi_mnist(tmp_path, n_train=-1)
    with pytest.raises(TypeError, match="n_val"):
        load_multi_mnist(tmp_path, n_val=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="val_source_fraction"):
        load_multi_mnist(tmp_path, val_source_fraction=1.0)
    with pytest.raises(FileNotFoundError, match="train-images"):
        load_multi_mnist(tmp_path, n_train=4, n_val=2, n_test=2, download=False, verify=False)


# ---------------------------------------------------------------- real data


@pytest.mark.data
@pytest.mark.parametrize("kind", ["mnist", "fashion-mnist"])
def test_real_mnist(real_data: Path, kind: str) -> None:
    x, y = load_mnist(real_data, kind, "train", download=False)
    assert x.shape == (60_000, 28, 28) and y.shape == (60_000,)
    xt, yt = load_mnist(real_data, kind, "test", download=False)
    assert xt.shape == (10_000, 28, 28) and yt.shape == (10_000,)
    if kind == "mnist":  # label counts from PROVENANCE.md
        assert np.bincount(y).tolist() == [
            5923,
            6742,
            5958,
            6131,
            5842,
            5421,
            5918,
            6265,
            5851,
            5949,
        ]
        assert np.bincount(yt).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
        assert abs(float(x.mean()) - 33.318) < 1e-3
    else:
        assert np.bincount(y).tolist() == [6000] * 10
        assert abs(float(x.mean()) - 72.94) < 1e-2


@pytest.mark.data
def test_real_multi_mnist(real_data: Path) -> None:
    d = load_multi_mnist(real_data, n_train=2000, n_val=500, n_test=500, download=False)
    assert d.train.X.shape == (2000, 1, 36, 36)
    assert d.test.X.shape == (500, 1, 36, 36)
    assert 0 <= int(d.train.y1.min()) and int(d.train.y2.max()) <= 9
