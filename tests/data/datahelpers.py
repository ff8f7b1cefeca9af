"""Helpers for the data-loader tests: tiny on-disk fixtures in upstream formats."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

# ../shared/data relative to the repository root.
REAL_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"

_IDX_CODES = {
    np.dtype(np.uint8): 0x08,
    np.dtype(np.int8): 0x09,
    np.dtype(">i2"): 0x0B,
    np.dtype(">i4"): 0x0C,
    np.dtype(">f4"): 0x0D,
    np.dtype(">f8"): 0x0E,
}


def idx_bytes(arr: np.ndarray) -> bytes:
    """Serialise ``arr`` in IDX format (big-endian)."""
    dt = arr.dtype if arr.dtype.itemsize == 1 else arr.dtype.newbyteorder(">")
    header = struct.pack(">BBBB", 0, 0, _IDX_CODES[dt], arr.ndim)
    header += struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(dt).tobytes()


def write_idx(path: Path, arr: np.ndarray, compress: bool = True) -> Path:
    """Write ``arr`` as an IDX file (gzip-compressed unless ``compress`` is false)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = idx_bytes(arr)
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def write_mnist_dir(
    root: Path,
    kind: str,
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
) -> Path:
    """Write a tiny MNIST-layout directory ``root/kind`` with the given arrays."""
    for prefix, (imgs, lbls) in (("train", train), ("t10k", test)):
        write_idx(root / kind / f"{prefix}-images-idx3-ubyte.gz", imgs.astype(np.uint8))
        write_idx(root / kind / f"{prefix}-labels-idx1-ubyte.gz", lbls.astype(np.uint8))
    return root
