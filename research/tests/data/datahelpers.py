"""Helpers for the data-loader tests: tiny on-disk fixtures in upstream formats."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

# The real data, read when a folder shared/data sits beside the repository (as on CI).
REAL_DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"

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


ML100K_OCC = ("administrator", "artist", "doctor", "student", "writer")


def write_ml100k(
    root: Path, n_users: int = 6, n_items: int = 9, density: float = 0.5, seed: int = 0
) -> tuple[Path, np.ndarray]:
    """Write u.data / u.user / u.item for a tiny random ML-100K; return (dir, ratings (N,3))."""
    rng = np.random.default_rng(seed)
    d = root / "movielens" / "ml-100k"
    d.mkdir(parents=True, exist_ok=True)
    rated = rng.random((n_users, n_items)) < density
    rated[:, 0] = True  # every user has a rating; user 1 rates all but one item
    rated[0, :] = True
    rated[0, -1] = False
    users, items = np.nonzero(rated)
    ratings = np.stack([users + 1, items + 1, rng.integers(1, 6, users.size)], axis=1)
    ratings = ratings[rng.permutation(len(ratings))]
    lines = [f"{u}\t{i}\t{r}\t{880000000 + k}" for k, (u, i, r) in enumerate(ratings)]
    (d / "u.data").write_text("\n".join(lines) + "\n")
    ages = [7, 18, 30, 44, 49, 70]
    ulines = [
        f"{u}|{ages[(u - 1) % 6]}|{'MF'[u % 2]}|{ML100K_OCC[u % 5]}|{10000 + u}"
        for u in range(1, n_users + 1)
    ]
    (d / "u.user").write_text("\n".join(ulines) + "\n")
    ilines = []
    for i in range(1, n_items + 1):
        flags = ["0"] * 19
        flags[i % 19] = "1"
        title = f"Caf\xe9 {i} (1995)"
        ilines.append(f"{i}|{title}|01-Jan-1995||http://x/{i}|" + "|".join(flags))
    (d / "u.item").write_bytes(("\n".join(ilines) + "\n").encode("latin-1"))
    return d, ratings


def write_ml1m(root: Path, seed: int = 0) -> tuple[Path, np.ndarray]:
    """Write users.dat / movies.dat and all three ratings forms for a tiny ML-1M.

    Movie ids are sparse (10, 20, ..., 80); ItemIndex numbers the rated movies 1..8 in id
    order. Movie 80 (ItemIndex 8) is left unresolved in the no-timestamps CSV. Users 1..4 are
    in the "users 0001-2999" form, i.e. ``ratings_users_0001-2999.dat`` covers users <= 4 here.
    Returns (dir, ratings (N, 3) with original ids).
    """
    rng = np.random.default_rng(seed)
    d = root / "movielens" / "ml-1m"
    d.mkdir(parents=True, exist_ok=True)
    n_users, movie_ids = 7, np.arange(10, 90, 10)
    rated = rng.random((n_users, movie_ids.size)) < 0.5
    rated[:, 0] = True
    rated[6, -1] = True  # only user 7 rates the unresolved movie 80
    rated[:6, -1] = False
    users, items = np.nonzero(rated)
    ratings = np.stack([users + 1, movie_ids[items], rng.integers(1, 6, users.size)], axis=1)
    ts = 970000000 + np.arange(len(ratings))
    full = [f"{u}::{m}::{r}::{t}" for (u, m, r), t in zip(ratings, ts, strict=True)]
    (d / "ratings.dat").write_text("\n".join(full) + "\n")
    part = [line for line, (u, _, _) in zip(full, ratings, strict=True) if u <= 4]
    (d / "ratings_users_0001-2999.dat").write_text("\n".join(part) + "\n")
    index = {int(m): k + 1 for k, m in enumerate(movie_ids)}
    csv = ["UserID,MovieID,Rating,ItemIndex"]
    order = np.lexsort((ratings[:, 1], ratings[:, 0]))
    for u, m, r in ratings[order]:
        shown = "" if m == 80 else str(m)
        csv.append(f"{u},{shown},{r},{index[int(m)]}")
    (d / "ratings_no_timestamps.csv.gz").write_bytes(
        gzip.compress(("\n".join(csv) + "\n").encode())
    )
    mp = ["ItemIndex,MovieID,CandidateMovieIDs"]
    mp += [f"{k},{m}," if m != 80 else f"{k},,79|80" for m, k in index.items()]
    (d / "item_index_to_movieid.csv").write_text("\n".join(mp) + "\n")
    codes = [1, 18, 25, 35, 45, 50, 56]
    users_dat = [f"{u}::{'MF'[u % 2]}::{codes[u - 1]}::{u * 2}::{55000 + u}" for u in range(1, 8)]
    (d / "users.dat").write_text("\n".join(users_dat) + "\n")
    genres = ["Action", "Comedy|Drama", "Children's", "Sci-Fi|Western", "Film-Noir"]
    movies = [f"{m}::Film {m} (1999)::{genres[k % 5]}" for k, m in enumerate(movie_ids)]
    movies.append("85::Never Rated (2000)::Horror")
    (d / "movies.dat").write_bytes(("\n".join(movies) + "\n").encode("latin-1"))
    return d, ratings
