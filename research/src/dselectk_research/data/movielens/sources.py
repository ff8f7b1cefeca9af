"""Which MovieLens files a variant is built from, and the dense item numbering.

* :data:`MOVIELENS_VARIANTS` and the ML-1M ratings sources (:data:`ML1M_RATINGS_SOURCES`:
  ``ratings.dat`` or one of the partial forms), the choice among them (``"auto"``) and the
  fetching and parsing of the ratings, users and movies files of a variant.
* The item key of each rating (MovieID, or ItemIndex for ``ratings_no_timestamps.csv.gz``),
  checked against ``item_index_to_movieid.csv`` when present.

Every file is obtained through :func:`~dselectk_research.data.fetch`, so local copies are verified
against their known checksums (unless ``verify`` is off). A partial ML-1M form chosen by
``"auto"`` (because ``ratings.dat`` is absent) gives a :class:`PartialDataWarning` saying which
form and how many users; asking for it by name (``ratings_source=``) uses it silently.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from dselectk_research.data._files import fetch, resolve_data_dir
from dselectk_research.data._integrity import PartialDataWarning
from dselectk_research.data.movielens.parse import (
    read_ml1m_item_index_map,
    read_ml1m_movies,
    read_ml1m_ratings,
    read_ml1m_ratings_no_timestamps,
    read_ml1m_users,
    read_ml100k_items,
    read_ml100k_ratings,
    read_ml100k_users,
)
from dselectk_research.data.movielens.schema import IntArray, Items, Ratings, Users

MOVIELENS_VARIANTS = ("ml-100k", "ml-1m")
ML1M_RATINGS_SOURCES = ("auto", "ratings.dat", "no-timestamps", "users-0001-2999")
_ML1M_FILES = {
    "ratings.dat": "movielens/ml-1m/ratings.dat",
    "no-timestamps": "movielens/ml-1m/ratings_no_timestamps.csv.gz",
    "users-0001-2999": "movielens/ml-1m/ratings_users_0001-2999.dat",
}
_ML1M_MAP = "movielens/ml-1m/item_index_to_movieid.csv"
_PARTIAL_FORMS = ("no-timestamps", "users-0001-2999")


def _pick_ml1m_source(
    ratings_source: str,
    data_dir: str | os.PathLike[str] | None,
    download: bool,
    verify: bool | None,
) -> tuple[str, Path]:
    if ratings_source != "auto":
        return ratings_source, fetch(_ML1M_FILES[ratings_source], data_dir, download, verify)
    root = resolve_data_dir(data_dir)
    for src in ("ratings.dat", "no-timestamps", "users-0001-2999"):
        if (root / _ML1M_FILES[src]).is_file():
            return src, fetch(_ML1M_FILES[src], data_dir, False, verify)
    try:
        return "ratings.dat", fetch(_ML1M_FILES["ratings.dat"], data_dir, download, verify)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            2,
            f"{exc.strerror} Alternatively, the partial forms "
            f"{_ML1M_FILES['no-timestamps']!r} or {_ML1M_FILES['users-0001-2999']!r} "
            f"are used when present in {root}; neither was found.",
            exc.filename,
        ) from exc


def _warn_partial(src: str, path: Path, ratings: Ratings) -> None:
    n_users = int(np.unique(ratings.user).size)
    if src == "no-timestamps":
        note = "without timestamps or the original line order"
        if ratings.item_index is not None and np.any(ratings.movie < 0):
            unresolved = int(np.unique(ratings.item_index[ratings.movie < 0]).size)
            note += f", {unresolved} movies without a resolved MovieID"
    else:
        lo, hi = (int(ratings.user.min()), int(ratings.user.max())) if len(ratings) else (0, 0)
        note = f"only users {lo} to {hi}; ML-1M has 6,040 users and 1,000,209 ratings"
    warnings.warn(
        f"ML-1M: ratings.dat was not found, so ratings_source='auto' uses the partial form "
        f"{src!r} ({path}): {n_users:,} users and {len(ratings):,} ratings, {note}. Pass "
        f"ratings_source={src!r} to use this form without this warning, or put the original "
        "ratings.dat in the data directory.",
        PartialDataWarning,
        stacklevel=4,
    )


def _load_sources(
    variant: str,
    ratings_source: str,
    data_dir: str | os.PathLike[str] | None,
    download: bool,
    verify: bool | None = None,
) -> tuple[str, Path, Ratings, Users, Items, list[Path]]:
    """Read (and verify) a variant's files: (source, ratings path, ..., every file read)."""
    if variant == "ml-100k":
        if ratings_source not in ("auto", "u.data"):
            raise ValueError(
                f"ratings_source must be 'auto' or 'u.data' for ml-100k, got {ratings_source!r}"
            )
        path = fetch("movielens/ml-100k/u.data", data_dir, download, verify)
        user_path = fetch("movielens/ml-100k/u.user", data_dir, download, verify)
        item_path = fetch("movielens/ml-100k/u.item", data_dir, download, verify)
        ratings = read_ml100k_ratings(path)
        users = read_ml100k_users(user_path)
        items = read_ml100k_items(item_path)
        return "u.data", path, ratings, users, items, [path, user_path, item_path]
    if ratings_source not in ML1M_RATINGS_SOURCES:
        raise ValueError(
            f"ratings_source must be one of {ML1M_RATINGS_SOURCES} for ml-1m, "
            f"got {ratings_source!r}"
        )
    src, path = _pick_ml1m_source(ratings_source, data_dir, download, verify)
    user_path = fetch("movielens/ml-1m/users.dat", data_dir, download, verify)
    item_path = fetch("movielens/ml-1m/movies.dat", data_dir, download, verify)
    files = [path, user_path, item_path]
    if src == "no-timestamps" and (resolve_data_dir(data_dir) / _ML1M_MAP).is_file():
        files.append(fetch(_ML1M_MAP, data_dir, False, verify))  # read by _item_keys
    if src == "no-timestamps":
        ratings = read_ml1m_ratings_no_timestamps(path)
    else:
        ratings = read_ml1m_ratings(path)
    if ratings_source == "auto" and src in _PARTIAL_FORMS:
        _warn_partial(src, path, ratings)
    users = read_ml1m_users(user_path)
    items = read_ml1m_movies(item_path)
    return src, path, ratings, users, items, files


def _item_keys(
    path: Path, ratings: Ratings, data_dir: str | os.PathLike[str] | None
) -> tuple[IntArray, IntArray, int]:
    """Return (item index per rating, movie id per item, number of items)."""
    if ratings.item_index is None:
        movie_ids, item = np.unique(ratings.movie, return_inverse=True)
        return item.astype(np.int64), movie_ids.astype(np.int64), int(movie_ids.size)
    # Keyed by ItemIndex, so the 20 unresolved movies keep their ratings.
    keys, first, item = np.unique(ratings.item_index, return_index=True, return_inverse=True)
    movie_ids = ratings.movie[first].astype(np.int64)
    key_of_row = keys[item]
    if np.any(ratings.movie != movie_ids[item]):
        bad = int(np.flatnonzero(ratings.movie != movie_ids[item])[0])
        raise ValueError(
            f"{path}, line {bad + 2}: ItemIndex {key_of_row[bad]} maps to MovieID "
            f"{movie_ids[item[bad]]} elsewhere in the file but {ratings.movie[bad]} here"
        )
    map_path = resolve_data_dir(data_dir) / _ML1M_MAP
    if map_path.is_file():
        m = read_ml1m_item_index_map(map_path)
        pos = np.searchsorted(m.item_index, keys)
        ok = (pos < m.item_index.size) & (
            m.item_index[np.minimum(pos, m.item_index.size - 1)] == keys
        )
        if not np.all(ok) or np.any(m.movie[pos] != movie_ids):
            raise ValueError(
                f"{map_path} disagrees with {path} on the ItemIndex -> MovieID mapping"
            )
    return item.astype(np.int64), movie_ids, int(keys.size)
