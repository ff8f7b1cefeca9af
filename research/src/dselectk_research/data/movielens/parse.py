"""Parsers of the raw MovieLens files, ML-100K and ML-1M, including the partial ML-1M forms.

* ML-100K: ``u.data`` (ratings), ``u.user`` (users), ``u.item`` (movies).
* ML-1M: ``ratings.dat`` and ``ratings_users_0001-2999.dat`` (same format),
  ``ratings_no_timestamps.csv.gz``, ``item_index_to_movieid.csv``, ``users.dat``,
  ``movies.dat``.

Every parser raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the file
and line number for malformed content.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dselectk_research.data.movielens._text import (
    _as_path,
    _check_ids,
    _check_unique,
    _check_values,
    _lines,
    _malformed,
    _parse_int_table,
    _read_text,
)
from dselectk_research.data.movielens.schema import (
    _GENDERS,
    _ML1M_AGE_CODES,
    ML1M_GENRES,
    ML1M_OCCUPATIONS,
    ML100K_GENRES,
    ML100K_OCCUPATIONS,
    ItemIndexMap,
    Items,
    Ratings,
    Users,
)


def _read_timestamped_ratings(
    path: str | os.PathLike[str], sep: str, names: tuple[str, str, str]
) -> Ratings:
    """``user item rating timestamp`` rows separated by ``sep``; ``names`` label the checks."""
    p = _as_path(path)
    arr = _parse_int_table(p, _read_text(p, "latin-1"), sep, 4)
    _check_ids(p, arr[:, 0], names[0])
    _check_ids(p, arr[:, 1], names[1])
    _check_values(p, arr[:, 2], 1, 5, names[2])
    return Ratings(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy(), arr[:, 3].copy())


def read_ml100k_ratings(path: str | os.PathLike[str]) -> Ratings:
    """Parse ML-100K ``u.data`` (tab-separated ``user item rating timestamp``).

    Args:
        path: Path of ``u.data`` (may be gzip-compressed).

    Returns:
        The ratings, with timestamps.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: On a malformed line or an out-of-range value; names file and line number.
    """
    return _read_timestamped_ratings(path, "\t", ("user id", "item id", "rating"))


def read_ml1m_ratings(path: str | os.PathLike[str]) -> Ratings:
    """Parse ML-1M ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``).

    Also reads ``ratings_users_0001-2999.dat``, which has the same format.

    Args:
        path: Path of the file (may be gzip-compressed).

    Returns:
        The ratings, with timestamps.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: On a malformed line or an out-of-range value; names file and line number.
    """
    return _read_timestamped_ratings(path, "::", ("UserID", "MovieID", "Rating"))


def read_ml1m_ratings_no_timestamps(path: str | os.PathLike[str]) -> Ratings:
    """Parse ``ratings_no_timestamps.csv.gz`` (``UserID,MovieID,Rating,ItemIndex`` + header).

    Args:
        path: Path of the file (gzip-compressed or plain CSV).

    Returns:
        The ratings without timestamps; ``movie`` is ``-1`` where MovieID is empty
        (unresolved), and ``item_index`` holds the ItemIndex column.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: On a bad header, a malformed line or an out-of-range value; names the file
            and line number.
    """
    p = _as_path(path)
    text = _read_text(p, "latin-1")
    header, _, body = text.partition("\n")
    if header.strip() != "UserID,MovieID,Rating,ItemIndex":
        raise _malformed(p, 1, "the header 'UserID,MovieID,Rating,ItemIndex'", header)
    arr = _parse_int_table(p, body, ",", 4, first_line=2, empty_ok=(1,))
    _check_ids(p, arr[:, 0], "UserID", 2)
    _check_values(p, arr[:, 1], -1, np.iinfo(np.int64).max, "MovieID", 2)
    _check_values(p, arr[:, 1] != 0, 1, 1, "MovieID (non-zero)", 2)
    _check_values(p, arr[:, 2], 1, 5, "Rating", 2)
    _check_ids(p, arr[:, 3], "ItemIndex", 2)
    return Ratings(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy(), None, arr[:, 3].copy())


def read_ml1m_item_index_map(path: str | os.PathLike[str]) -> ItemIndexMap:
    """Parse ``item_index_to_movieid.csv`` (``ItemIndex,MovieID,CandidateMovieIDs``).

    Args:
        path: Path of the file.

    Returns:
        The map; unresolved rows have ``movie == -1`` and their ``|``-separated candidates.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: On a bad header or malformed line; names the file and line number.
    """
    p = _as_path(path)
    lines = _lines(_read_text(p, "utf-8"))
    if not lines or lines[0].strip() != "ItemIndex,MovieID,CandidateMovieIDs":
        raise _malformed(
            p, 1, "the header 'ItemIndex,MovieID,CandidateMovieIDs'", lines[0] if lines else ""
        )
    expected = "ItemIndex,MovieID,CandidateMovieIDs with MovieID or candidates given"
    idx: list[int] = []
    movie: list[int] = []
    cands: list[tuple[int, ...]] = []
    for lineno, line in enumerate(lines[1:], start=2):
        parts = line.split(",")
        if len(parts) != 3:
            raise _malformed(p, lineno, expected, line)
        try:
            ii = int(parts[0])
            mid = int(parts[1]) if parts[1] else -1
            cand = tuple(int(c) for c in parts[2].split("|")) if parts[2] else ()
        except ValueError:
            raise _malformed(p, lineno, expected, line) from None
        if ii < 1 or (mid == -1) == (not cand) or (mid != -1 and mid < 1):
            raise _malformed(p, lineno, expected, line)
        idx.append(ii)
        movie.append(mid)
        cands.append(cand)
    return ItemIndexMap(np.asarray(idx, np.int64), np.asarray(movie, np.int64), cands)


def _age_bucket_from_years(age: int) -> int:
    for bucket, lower in enumerate(_ML1M_AGE_CODES[1:]):
        if age < lower:
            return bucket
    return len(_ML1M_AGE_CODES) - 1


def read_ml100k_users(path: str | os.PathLike[str]) -> Users:
    """Parse ML-100K ``u.user`` (``id|age|gender|occupation|zip``).

    Exact ages are mapped onto the seven ML-1M age buckets (:data:`AGE_BUCKETS`); occupations
    are indexed into :data:`ML100K_OCCUPATIONS`. The zip code is ignored.

    Args:
        path: Path of ``u.user``.

    Returns:
        The users.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: On a malformed line or unknown gender/occupation; names file and line.
    """
    p = _as_path(path)
    occ_index = {name: i for i, name in enumerate(ML100K_OCCUPATIONS)}
    expected = "'id|age|gender|occupation|zip' with gender M/F and a known occupation"
    ids, ages, genders, occs = [], [], [], []
    for lineno, line in enumerate(_lines(_read_text(p, "latin-1")), start=1):
        parts = line.split("|")
        if len(parts) != 5 or parts[2] not in _GENDERS or parts[3] not in occ_index:
            raise _malformed(p, lineno, expected, line)
        try:
            uid, age = int(parts[0]), int(parts[1])
        except ValueError:
            raise _malformed(p, lineno, expected, line) from None
        if uid < 1 or age < 0:
            raise _malformed(p, lineno, expected, line)
        ids.append(uid)
        ages.append(_age_bucket_from_years(age))
        genders.append(_GENDERS[parts[2]])
        occs.append(occ_index[parts[3]])
    return _make_users(p, ids, ages, genders, occs, ML100K_OCCUPATIONS)


def read_ml1m_users(path: str | os.PathLike[str]) -> Users:
    """Parse ML-1M ``users.dat`` (``UserID::Gender::Age::Occupation::Zip-code``).

    Args:
        path: Path of ``users.dat``.

    Returns:
        The users (age codes 1, 18, ..., 56 mapped to bucket indices 0..6).

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: On a malformed line or an unknown code; names the file and line number.
    """
    p = _as_path(path)
    age_index = {code: i for i, code in enumerate(_ML1M_AGE_CODES)}
    expected = "'UserID::Gender::Age::Occupation::Zip-code' with valid codes"
    ids, ages, genders, occs = [], [], [], []
    for lineno, line in enumerate(_lines(_read_text(p, "latin-1")), start=1):
        parts = line.split("::")
        if len(parts) != 5 or parts[1] not in _GENDERS:
            raise _malformed(p, lineno, expected, line)
        try:
            uid, age, occ = int(parts[0]), int(parts[2]), int(parts[3])
        except ValueError:
            raise _malformed(p, lineno, expected, line) from None
        if uid < 1 or age not in age_index or not 0 <= occ < len(ML1M_OCCUPATIONS):
            raise _malformed(p, lineno, expected, line)
        ids.append(uid)
        ages.append(age_index[age])
        genders.append(_GENDERS[parts[1]])
        occs.append(occ)
    return _make_users(p, ids, ages, genders, occs, ML1M_OCCUPATIONS)


def _make_users(
    path: Path,
    ids: list[int],
    ages: list[int],
    genders: list[int],
    occs: list[int],
    names: tuple[str, ...],
) -> Users:
    id_arr = np.asarray(ids, dtype=np.int64)
    _check_unique(path, id_arr, "user id")
    return Users(
        id_arr,
        np.asarray(ages, dtype=np.int64),
        np.asarray(genders, dtype=np.int64),
        np.asarray(occs, dtype=np.int64),
        names,
    )


def read_ml100k_items(path: str | os.PathLike[str]) -> Items:
    """Parse ML-100K ``u.item`` (Latin-1, ``|``-separated, 5 fields + 19 genre flags).

    Args:
        path: Path of ``u.item``.

    Returns:
        The movies with their 19-genre multi-hot vectors (:data:`ML100K_GENRES`).

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: On a malformed line; names the file and line number.
    """
    p = _as_path(path)
    ng = len(ML100K_GENRES)
    expected = f"{5 + ng} '|'-separated fields ending in {ng} 0/1 genre flags"
    ids: list[int] = []
    titles: list[str] = []
    flags: list[list[int]] = []
    for lineno, line in enumerate(_lines(_read_text(p, "latin-1")), start=1):
        parts = line.split("|")
        if len(parts) != 5 + ng or any(f not in ("0", "1") for f in parts[5:]):
            raise _malformed(p, lineno, expected, line)
        try:
            mid = int(parts[0])
        except ValueError:
            raise _malformed(p, lineno, expected, line) from None
        if mid < 1:
            raise _malformed(p, lineno, expected, line)
        ids.append(mid)
        titles.append(parts[1])
        flags.append([int(f) for f in parts[5:]])
    id_arr = np.asarray(ids, dtype=np.int64)
    _check_unique(p, id_arr, "movie id")
    genres = np.asarray(flags, dtype=np.uint8).reshape(-1, ng)
    return Items(id_arr, titles, genres, ML100K_GENRES)


def read_ml1m_movies(path: str | os.PathLike[str]) -> Items:
    """Parse ML-1M ``movies.dat`` (Latin-1, ``MovieID::Title::Genres``, genres ``|``-separated).

    Args:
        path: Path of ``movies.dat``.

    Returns:
        The movies with their 18-genre multi-hot vectors (:data:`ML1M_GENRES`).

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: On a malformed line or an unknown genre; names the file and line number.
    """
    p = _as_path(path)
    gindex = {g: i for i, g in enumerate(ML1M_GENRES)}
    expected = "'MovieID::Title::Genres' with known '|'-separated genres"
    ids: list[int] = []
    titles: list[str] = []
    lines = _lines(_read_text(p, "latin-1"))
    genres = np.zeros((len(lines), len(ML1M_GENRES)), dtype=np.uint8)
    for row, line in enumerate(lines):
        lineno = row + 1
        parts = line.split("::")
        if len(parts) != 3:
            raise _malformed(p, lineno, expected, line)
        try:
            mid = int(parts[0])
        except ValueError:
            raise _malformed(p, lineno, expected, line) from None
        names = parts[2].split("|") if parts[2] else []
        if mid < 1 or any(g not in gindex for g in names):
            raise _malformed(p, lineno, expected, line)
        ids.append(mid)
        titles.append(parts[1])
        for g in names:
            genres[row, gindex[g]] = 1
    id_arr = np.asarray(ids, dtype=np.int64)
    _check_unique(p, id_arr, "MovieID")
    return Items(id_arr, titles, genres, ML1M_GENRES)
