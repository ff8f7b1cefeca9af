"""MNIST / Fashion-MNIST (IDX format) and the Multi-MNIST construction of the paper.

Multi-MNIST and Multi-Fashion-MNIST follow Section 4.2 and Appendix D.2 of the DSelect-k paper
(Hazimeh et al., 2021), which in turn follows Sabour et al. (2017): two images are drawn uniformly
at random, one is shifted 4 pixels towards the top-left and the other 4 pixels towards the
bottom-right, and the two are overlaid (pixelwise maximum) on a 36x36 canvas. Task 1 predicts
the class of the top-left item and task 2 the class of the bottom-right item.
"""

from __future__ import annotations

import gzip
import os
import struct
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from dselectk.io import save_npz
from dselectk_research.data._files import fetch, resolve_data_dir
from dselectk_research.data._integrity import fingerprint

__all__ = [
    "MNIST_KINDS",
    "MultiMNISTData",
    "MultiTaskImages",
    "load_mnist",
    "load_multi_mnist",
    "make_multi_mnist",
    "read_idx",
]

MNIST_KINDS = ("mnist", "fashion-mnist")
"""Values accepted for the ``kind`` argument."""

_SPLITS = ("train", "test")

# IDX type codes (third byte of the magic number) -> big-endian numpy dtype.
_IDX_DTYPES: dict[int, np.dtype[np.generic]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _read_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(2)
    if head != b"\x1f\x8b":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as g:
            return g.read()
    except (EOFError, OSError, zlib.error) as exc:
        raise ValueError(f"IDX file {path} is a corrupt or truncated gzip stream: {exc}") from exc


def read_idx(path: str | os.PathLike[str]) -> npt.NDArray[np.generic]:
    """Read an IDX file (plain or gzip-compressed) into a numpy array.

    The IDX header is a big-endian magic number ``0x0000TTDD`` (``TT`` = element type code,
    ``DD`` = number of dimensions) followed by ``DD`` big-endian uint32 sizes and the payload.
    Gzip compression is detected from the file content, not the file name.

    Args:
        path: File to read.

    Returns:
        Array of shape given by the header, in native byte order, with the dtype given by the
        type code (uint8 for MNIST images and labels).

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If the magic number is invalid, the type code is unknown, or the payload is
            truncated or has trailing bytes. The message names the file.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(2, f"IDX file {p} does not exist", str(p))
    raw = _read_bytes(p)
    if len(raw) < 4:
        raise ValueError(f"IDX file {p} is too short ({len(raw)} bytes) to hold a magic number")
    zero0, zero1, code, ndim = raw[0], raw[1], raw[2], raw[3]
    if zero0 != 0 or zero1 != 0:
        raise ValueError(
            f"IDX file {p} has bad magic number 0x{raw[:4].hex()}: expected the first two bytes "
            "to be zero (0x0000TTDD)"
        )
    if code not in _IDX_DTYPES:
        expected = ", ".join(f"0x{c:02X}" for c in _IDX_DTYPES)
        raise ValueError(
            f"IDX file {p} has unknown element type code 0x{code:02X}: expected one of {expected}"
        )
    if ndim == 0:
        raise ValueError(f"IDX file {p} declares 0 dimensions: expected at least 1")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(
            f"IDX file {p} is truncated: header declares {ndim} dimensions ({header} header "
            f"bytes) but the file has only {len(raw)} bytes"
        )
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = _IDX_DTYPES[code]
    expected_bytes = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    got = len(raw) - header
    if got != expected_bytes:
        what = "truncated" if got < expected_bytes else "longer than its header declares"
        raise ValueError(
            f"IDX file {p} is {what}: dimensions {tuple(dims)} of {dtype} need "
            f"{expected_bytes} payload bytes, found {got}"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _check_kind(kind: str) -> None:
    if kind not in MNIST_KINDS:
        raise ValueError(f"kind must be one of {MNIST_KINDS}, got {kind!r}")


def _source_names(kind: str) -> list[str]:
    """Registry names of the four IDX files of ``kind``."""
    return [
        f"{kind}/{prefix}-{what}-ubyte.gz"
        for prefix in ("train", "t10k")
        for what in ("images-idx3", "labels-idx1")
    ]


def load_mnist(
    data_dir: str | os.PathLike[str] | None = None,
    kind: str = "mnist",
    split: str = "train",
    download: bool = True,
    verify: bool | None = None,
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Load MNIST or Fashion-MNIST images and labels from the official IDX files.

    Files are looked up as ``<data_dir>/<kind>/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``
    (downloaded there if missing and ``download`` is true) and verified against the known
    checksums on every use, so e.g. Fashion-MNIST files under ``mnist/`` are refused. Their
    fingerprint is ``dselectk_research.data.fingerprint([...the two paths...])``.

    Args:
        data_dir: Data directory; see :func:`dselectk_research.data.resolve_data_dir`.
        kind: ``"mnist"`` or ``"fashion-mnist"``.
        split: ``"train"`` (60,000 examples) or ``"test"`` (10,000 examples).
        download: Whether missing files may be downloaded.
        verify: Whether local files are checked against their known checksums; None: yes,
            unless ``$DSELECTK_VERIFY`` is ``0``. False uses your own files as they are.

    Returns:
        ``(images, labels)``: uint8 array of shape ``(N, 28, 28)`` and int64 array of shape
        ``(N,)`` with values in ``0..9``.

    Raises:
        ValueError: For a bad ``kind``/``split`` or malformed files.
        ChecksumError: If a local file is not the known file of that name.
        FileNotFoundError: If a file is missing and cannot be downloaded.
    """
    _check_kind(kind)
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    prefix = "train" if split == "train" else "t10k"
    img_path = fetch(f"{kind}/{prefix}-images-idx3-ubyte.gz", data_dir, download, verify)
    lbl_path = fetch(f"{kind}/{prefix}-labels-idx1-ubyte.gz", data_dir, download, verify)
    images = read_idx(img_path)
    labels = read_idx(lbl_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise ValueError(
            f"IDX file {img_path}: expected uint8 images of shape (N, 28, 28), got "
            f"{images.dtype} {images.shape}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise ValueError(
            f"IDX file {lbl_path}: expected uint8 labels of shape (N,), got "
            f"{labels.dtype} {labels.shape}"
        )
    if labels.shape[0] != images.shape[0]:
        raise ValueError(
            f"{img_path} has {images.shape[0]} images but {lbl_path} has {labels.shape[0]} labels"
        )
    if labels.size and int(labels.max()) > 9:
        raise ValueError(f"IDX file {lbl_path}: expected labels in 0..9, found {labels.max()}")
    return images.astype(np.uint8, copy=False), labels.astype(np.int64)


def make_multi_mnist(
    images: npt.ArrayLike,
    labels: npt.ArrayLike,
    n: int,
    seed: int | np.random.SeedSequence = 0,
    shift: int = 4,
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Build ``n`` two-item overlaid examples (Multi-MNIST construction).

    For each example two *distinct* source images are drawn uniformly at random (with
    replacement across examples). With ``s = shift`` and source size ``H x W``, the canvas is
    ``(H + 2s) x (W + 2s)``; the first image is placed at offset ``(0, 0)`` (i.e. shifted ``s``
    pixels up and left from the centre) and the second at offset ``(2s, 2s)`` (shifted ``s``
    pixels down and right). The canvas is the pixelwise maximum of the two.

    Args:
        images: Source images, shape ``(M, H, W)``, ``M >= 2``; usually uint8.
        labels: Source labels, shape ``(M,)``.
        n: Number of examples to build (``>= 0``).
        seed: Seed (or :class:`numpy.random.SeedSequence`); the output is a deterministic
            function of the inputs and the seed.
        shift: Shift in pixels (4 in the paper).

    Returns:
        ``(X, y_top_left, y_bottom_right)``: canvases of shape ``(n, H + 2s, W + 2s)`` with the
        dtype of ``images``, and the int64 labels of the top-left and bottom-right items.

    Raises:
        TypeError: If ``n`` or ``shift`` is not an int.
        ValueError: On inconsistent shapes, fewer than two images, or negative ``n``/``shift``.
    """
    imgs = np.asarray(images)
    lbls = np.asarray(labels)
    if isinstance(n, bool) or not isinstance(n, int | np.integer):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    if isinstance(shift, bool) or not isinstance(shift, int | np.integer):
        raise TypeError(f"shift must be an int, got {type(shift).__name__}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    if imgs.ndim != 3:
        raise ValueError(f"images must have shape (M, H, W), got shape {imgs.shape}")
    if lbls.shape != (imgs.shape[0],):
        raise ValueError(
            f"labels must have shape ({imgs.shape[0]},) to match images, got {lbls.shape}"
        )
    m, h, w = imgs.shape
    if m < 2:
        raise ValueError(f"images must contain at least 2 images to pair, got {m}")
    rng = np.random.default_rng(seed)
    first = rng.integers(0, m, size=n)
    # Second index uniform over the other m - 1 images, so an image is never paired with itself.
    second = (first + rng.integers(1, m, size=n)) % m
    d = 2 * shift
    canvas = np.zeros((n, h + d, w + d), dtype=imgs.dtype)
    canvas[:, :h, :w] = imgs[first]
    np.maximum(canvas[:, d:, d:], imgs[second], out=canvas[:, d:, d:])
    return canvas, lbls[first].astype(np.int64), lbls[second].astype(np.int64)


@dataclass(frozen=True)
class MultiTaskImages:
    """One split of Multi-(Fashion-)MNIST.

    Attributes:
        X: float32 tensor ``(N, 1, 36, 36)`` with values in ``[0, 1]``.
        y1: int64 tensor ``(N,)``, class of the top-left item (task 1).
        y2: int64 tensor ``(N,)``, class of the bottom-right item (task 2).
    """

    X: torch.Tensor
    y1: torch.Tensor
    y2: torch.Tensor

    def __len__(self) -> int:
        return int(self.X.shape[0])

    def dataset(self) -> torch.utils.data.TensorDataset:
        """Return a :class:`~torch.utils.data.TensorDataset` yielding ``(X, y1, y2)``."""
        return torch.utils.data.TensorDataset(self.X, self.y1, self.y2)


@dataclass(frozen=True)
class MultiMNISTData:
    """Train/validation/test splits of Multi-MNIST or Multi-Fashion-MNIST.

    Attributes:
        train: Built from the training-pool part of the official training split.
        val: Built from the held-out part of the official training split (disjoint source
            images from ``train``).
        test: Built only from the official test split.
        kind: ``"mnist"`` or ``"fashion-mnist"``.
        num_classes: Number of classes per task (10).
        fingerprint: Short stable hash of the four source IDX files (see
            :func:`dselectk_research.data.fingerprint`); ``""`` only for a cache written before
            fingerprints were recorded, read without its source files.
    """

    train: MultiTaskImages
    val: MultiTaskImages
    test: MultiTaskImages
    kind: str
    num_classes: int = 10
    fingerprint: str = ""


def _to_split(
    x: npt.NDArray[np.uint8], y1: npt.NDArray[np.int64], y2: npt.NDArray[np.int64]
) -> MultiTaskImages:
    xt = torch.from_numpy(x).unsqueeze(1).to(torch.float32).div_(255.0)
    return MultiTaskImages(X=xt, y1=torch.from_numpy(y1), y2=torch.from_numpy(y2))


def _read_cache(
    cache_path: Path,
    kind: str,
    data_dir: str | os.PathLike[str] | None,
    verify: bool | None,
) -> MultiMNISTData | None:
    """The cached splits, or None when the present source files do not match the cache."""
    root = resolve_data_dir(data_dir)
    sources = [root / name for name in _source_names(kind)]
    present = [
        fetch(name, data_dir, False, verify)
        for name, path in zip(_source_names(kind), sources, strict=True)
        if path.is_file()
    ]
    with np.load(cache_path) as z:
        stored = str(z["fingerprint"]) if "fingerprint" in z.files else ""
        if len(present) == len(sources) and stored != fingerprint(present):
            return None  # built from other source files: rebuild
        return MultiMNISTData(
            train=_to_split(z["x_train"], z["y1_train"], z["y2_train"]),
            val=_to_split(z["x_val"], z["y1_val"], z["y2_val"]),
            test=_to_split(z["x_test"], z["y1_test"], z["y2_test"]),
            kind=kind,
            fingerprint=stored,
        )


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def load_multi_mnist(
    data_dir: str | os.PathLike[str] | None = None,
    kind: str = "mnist",
    n_train: int = 100_000,
    n_val: int = 20_000,
    n_test: int = 20_000,
    seed: int = 0,
    val_source_fraction: float | None = None,
    cache: bool = False,
    download: bool = True,
    verify: bool | None = None,
) -> MultiMNISTData:
    """Build Multi-MNIST / Multi-Fashion-MNIST train, validation and test splits.

    The paper (Section 4.2) uses 100,000 / 20,000 / 20,000 examples. It does not say how the
    validation examples relate to the source images, so here the 60,000 official training
    images are first partitioned at random (from ``seed``) into a training pool and a
    validation pool, and each split is built only from its own pool: no source image is shared
    between train and val. The test split is built only from the 10,000 official test images.

    Args:
        data_dir: Data directory; see :func:`dselectk_research.data.resolve_data_dir`.
        kind: ``"mnist"`` or ``"fashion-mnist"``.
        n_train: Number of training examples.
        n_val: Number of validation examples.
        n_test: Number of test examples.
        seed: Seed; the whole result is a deterministic function of it and the data.
        val_source_fraction: Fraction of the official training images put in the validation
            pool. Defaults to ``n_val / (n_train + n_val)`` (1/6 for the paper's sizes, i.e.
            10,000 images); ignored when ``n_val == 0``.
        cache: If true, the built uint8 canvases and labels are stored as
            ``<data_dir>/multi-<kind>/multi_<...>.npz`` (atomic write) together with the
            fingerprint of the source files, and reused on later calls with the same
            arguments. When the source files are present they are verified and the cache is
            used only if their fingerprint matches (else it is rebuilt); without them the
            cache is used as it is. A cache that cannot be written only warns.
        download: Whether missing source files may be downloaded.
        verify: Whether local source files are checked against their known checksums; None:
            yes, unless ``$DSELECTK_VERIFY`` is ``0``. False uses your own files as they are.

    Returns:
        A :class:`MultiMNISTData` with float32 ``X`` of shape ``(N, 1, 36, 36)`` in ``[0, 1]``
        and int64 ``y1``/``y2`` for each split.

    Raises:
        TypeError: If a count or the seed is not an int.
        ValueError: For a bad ``kind``, negative counts or a bad ``val_source_fraction``.
        FileNotFoundError: If the source files are missing and cannot be downloaded.
    """
    _check_kind(kind)
    _check_count("n_train", n_train, 0)
    _check_count("n_val", n_val, 0)
    _check_count("n_test", n_test, 0)
    _check_count("seed", seed, 0)
    if val_source_fraction is None:
        frac = n_val / (n_train + n_val) if n_train + n_val > 0 else 0.0
    else:
        frac = float(val_source_fraction)
        if not 0.0 < frac < 1.0:
            raise ValueError(
                f"val_source_fraction must be strictly between 0 and 1, got {val_source_fraction}"
            )
    if n_val == 0:
        frac = 0.0

    root = resolve_data_dir(data_dir)
    cache_path: Path | None = None
    if cache:
        tag = f"multi_s{seed}_tr{n_train}_va{n_val}_te{n_test}_f{frac:.6f}.npz"
        cache_path = root / f"multi-{kind}" / tag
        if cache_path.is_file():
            hit = _read_cache(cache_path, kind, data_dir, verify)
            if hit is not None:
                return hit

    train_imgs, train_lbls = load_mnist(data_dir, kind, "train", download, verify)
    test_imgs, test_lbls = load_mnist(data_dir, kind, "test", download, verify)
    data_fingerprint = fingerprint([root / name for name in _source_names(kind)])

    ss_partition, ss_train, ss_val, ss_test = np.random.SeedSequence(seed).spawn(4)
    perm = np.random.default_rng(ss_partition).permutation(train_imgs.shape[0])
    n_val_src = round(frac * train_imgs.shape[0])
    if n_val > 0:
        n_val_src = min(max(n_val_src, 2), train_imgs.shape[0] - 2)
    val_idx = np.sort(perm[:n_val_src])
    tr_idx = np.sort(perm[n_val_src:])

    built: dict[str, tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64]]]
    built = {}
    for split, ss, count, imgs, lbls in (
        ("train", ss_train, n_train, train_imgs[tr_idx], train_lbls[tr_idx]),
        ("val", ss_val, n_val, train_imgs[val_idx], train_lbls[val_idx]),
        ("test", ss_test, n_test, test_imgs, test_lbls),
    ):
        if count == 0:
            empty = np.zeros(0, dtype=np.int64)
            built[split] = (np.zeros((0, 36, 36), dtype=np.uint8), empty, empty.copy())
        else:
            built[split] = make_multi_mnist(imgs, lbls, count, ss)

    if cache_path is not None:
        arrays: dict[str, npt.NDArray[np.generic]] = {"fingerprint": np.array(data_fingerprint)}
        for split, (x, y1, y2) in built.items():
            arrays[f"x_{split}"], arrays[f"y1_{split}"], arrays[f"y2_{split}"] = x, y1, y2
        try:
            save_npz(cache_path, **arrays)
        except OSError as exc:
            warnings.warn(
                f"could not write Multi-MNIST cache {cache_path}: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )

    return MultiMNISTData(
        train=_to_split(*built["train"]),
        val=_to_split(*built["val"]),
        test=_to_split(*built["test"]),
        kind=kind,
        fingerprint=data_fingerprint,
    )
