"""MovieLens parsers and the two-task recommendation dataset of the DSelect-k paper.

Section 4.1 of the paper (following Wang et al., 2020) uses MovieLens with two tasks:

* task 1, *watch*: binary classification, will the user watch (rate) the movie? Rated
  (user, movie) pairs are positives; negatives are sampled uniformly from the movies the user
  has not rated (``neg_ratio`` negatives per positive, 1 in the paper).
* task 2, *rating*: regression of the user's rating. Negatives get the label
  ``negative_rating`` (0 by default); :attr:`MovieLensSplit.rating_mask` marks the observed
  ratings so the rating loss can be restricted to positives instead.

For ML-1M the paper uses 1.6M / 200k / 200k train / validation / test examples, i.e. a random
0.8 / 0.1 / 0.1 split of the 2M examples (1M ratings + 1M negatives).

ML-1M ratings sources. The original ``ratings.dat`` is used when present (or downloaded). This
project's ``shared/data`` copy lacks it and holds two partial forms instead (see
``shared/data/PROVENANCE.md``):

* ``ratings_no_timestamps.csv.gz``: all 1,000,209 ratings without timestamps, columns
  ``UserID,MovieID,Rating,ItemIndex``. ``ItemIndex`` (1..3706) numbers the rated movies in
  increasing MovieID order; 20 of them (35 ratings) have no resolved MovieID (empty field).
  Items are keyed by ``ItemIndex`` here, so all ratings are kept and item indices coincide with
  those obtained from the original ``ratings.dat``; the unresolved items have no genres (all-zero
  multi-hot) and ``item_movie_ids == -1``.
* ``ratings_users_0001-2999.dat``: the original lines for users 1..2999 only (487,650 ratings,
  with timestamps), in ``ratings.dat`` format.

``item_index_to_movieid.csv`` (the ItemIndex -> MovieID map) is read when present and checked
against the ratings file.
"""

from __future__ import annotations

import gzip
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from dselectk.data._files import fetch, resolve_data_dir

__all__ = [
    "ML1M_GENRES",
    "ML1M_OCCUPATIONS",
    "ML1M_RATINGS_SOURCES",
    "ML100K_GENRES",
    "ML100K_OCCUPATIONS",
    "MOVIELENS_VARIANTS",
    "ItemIndexMap",
    "Items",
    "MovieLensData",
    "MovieLensSplit",
    "Ratings",
    "Users",
    "load_movielens",
    "read_ml1m_item_index_map",
    "read_ml1m_movies",
    "read_ml1m_ratings",
    "read_ml1m_ratings_no_timestamps",
    "read_ml1m_users",
    "read_ml100k_items",
    "read_ml100k_ratings",
    "read_ml100k_users",
    "sample_negatives",
]

IntArray = npt.NDArray[np.int64]

MOVIELENS_VARIANTS = ("ml-100k", "ml-1m")
ML1M_RATINGS_SOURCES = ("auto", "ratings.dat", "no-timestamps", "users-0001-2999")
_ML1M_FILES = {
    "ratings.dat": "movielens/ml-1m/ratings.dat",
    "no-timestamps": "movielens/ml-1m/ratings_no_timestamps.csv.gz",
    "users-0001-2999": "movielens/ml-1m/ratings_users_0001-2999.dat",
}
_ML1M_MAP = "movielens/ml-1m/item_index_to_movieid.csv"

ML100K_GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
    "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance",
    "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
ML1M_GENRES = ML100K_GENRES[1:]
ML100K_OCCUPATIONS = (
    "administrator", "artist", "doctor", "educator", "engineer", "entertainment", "executive",
    "healthcare", "homemaker", "lawyer", "librarian", "marketing", "none", "other",
    "programmer", "retired", "salesman", "scientist", "student", "technician", "writer",
)  # fmt: skip
ML1M_OCCUPATIONS = (
    "other", "academic/educator", "artist", "clerical/admin", "college/grad student",
    "customer service", "doctor/health care", "executive/managerial", "farmer", "homemaker",
    "K-12 student", "lawyer", "programmer", "retired", "sales/marketing", "scientist",
    "self-employed", "technician/engineer", "tradesman/craftsman", "unemployed", "writer",
)  # fmt: skip
AGE_BUCKETS = ("<18", "18-24", "25-34", "35-44", "45-49", "50-55", "56+")
"""The seven ML-1M age ranges; ML-100K's exact ages are mapped onto the same buckets."""
_ML1M_AGE_CODES = (1, 18, 25, 35, 45, 50, 56)
_GENDERS = {"M": 0, "F": 1}


# --------------------------------------------------------------------------------------------
# Containers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ratings:
    """Parsed rating rows (one entry per line of the file, in file order).

    Attributes:
        user: Original user ids.
        movie: Original MovieLens movie ids; ``-1`` where unknown (unresolved ItemIndex rows of
            ``ratings_no_timestamps.csv.gz``).
        rating: Ratings (1..5).
        timestamp: Unix timestamps, or None when the source has none.
        item_index: The source's own dense movie numbering (``ItemIndex`` of
            ``ratings_no_timestamps.csv.gz``), or None.
    """

    user: IntArray
    movie: IntArray
    rating: IntArray
    timestamp: IntArray | None = None
    item_index: IntArray | None = None

    def __len__(self) -> int:
        return int(self.user.shape[0])


@dataclass(frozen=True)
class Users:
    """User side information, one row per user in file order.

    Attributes:
        ids: Original user ids.
        age: Age bucket index into :data:`AGE_BUCKETS` (0..6).
        gender: 0 = male, 1 = female.
        occupation: Index into :data:`ML100K_OCCUPATIONS` or :data:`ML1M_OCCUPATIONS`.
        occupation_names: The occupation vocabulary.
    """

    ids: IntArray
    age: IntArray
    gender: IntArray
    occupation: IntArray
    occupation_names: tuple[str, ...]


@dataclass(frozen=True)
class Items:
    """Movie side information, one row per movie in file order.

    Attributes:
        ids: Original movie ids.
        titles: Titles.
        genres: uint8 multi-hot genre matrix, shape ``(num_movies, len(genre_names))``.
        genre_names: The genre vocabulary.
    """

    ids: IntArray
    titles: list[str]
    genres: npt.NDArray[np.uint8]
    genre_names: tuple[str, ...]


@dataclass(frozen=True)
class ItemIndexMap:
    """Contents of ``item_index_to_movieid.csv``.

    Attributes:
        item_index: ItemIndex values (1..3706).
        movie: Resolved MovieLens id, ``-1`` when ambiguous.
        candidates: For each row, the candidate movie ids (empty tuple when resolved).
    """

    item_index: IntArray
    movie: IntArray
    candidates: list[tuple[int, ...]]


# --------------------------------------------------------------------------------------------
# Low-level parsing helpers
# --------------------------------------------------------------------------------------------


def _read_text(path: Path, encoding: str) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError) as exc:
            raise ValueError(f"{path}: corrupt or truncated gzip data: {exc}") from exc
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not valid {encoding} text: {exc}") from exc
    return text.replace("\r\n", "\n")


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    while lines and lines[-1] == "":
        lines.pop()
    return lines


def _malformed(path: Path, lineno: int, expected: str, line: str) -> ValueError:
    shown = line if len(line) <= 80 else line[:77] + "..."
    return ValueError(f"{path}, line {lineno}: malformed line, expected {expected}; got {shown!r}")


def _parse_int_table(
    path: Path,
    text: str,
    sep: str,
    ncols: int,
    first_line: int = 1,
    empty_ok: Sequence[int] = (),
) -> IntArray:
    """Parse ``text`` as rows of ``ncols`` ``sep``-separated integers.

    Empty fields in the columns listed in ``empty_ok`` become ``-1``. ``first_line`` is the
    1-based file line number of the first line of ``text`` (used in error messages).
    """
    expected = f"{ncols} {sep!r}-separated integer fields"
    body = text.rstrip("\n")
    if not body:
        return np.zeros((0, ncols), dtype=np.int64)
    fast = "\n\n" not in body and not body.startswith("\n")
    if sep == "::":
        # Map "::" to a single-character delimiter, but only when no stray ':' would merge.
        fast = fast and body.count(":") == 2 * body.count("::") and ":::" not in body
        fast_text, delim = body.replace("::", ":"), ":"
    else:
        fast_text, delim = body, sep
    if empty_ok and fast:
        # Only one column may be empty in our formats; mark it with -1 for loadtxt.
        col = empty_ok[0]
        if len(empty_ok) != 1 or not 0 < col < ncols - 1:
            raise RuntimeError("internal error: unsupported empty_ok specification")
        fast_text = fast_text.replace(delim + delim, delim + "-1" + delim)
    if fast:
        try:
            arr = np.loadtxt(io.StringIO(fast_text), delimiter=delim, dtype=np.int64, ndmin=2)
        except ValueError:
            pass
        else:
            if arr.shape[1] == ncols and arr.shape[0] == body.count("\n") + 1:
                return arr
    # Slow path: find (and report) the first malformed line.
    rows: list[list[int]] = []
    for offset, line in enumerate(body.split("\n")):
        lineno = first_line + offset
        parts = line.split(sep)
        if len(parts) != ncols:
            raise _malformed(path, lineno, expected, line)
        row: list[int] = []
        for j, part in enumerate(parts):
            if part == "" and j in empty_ok:
                row.append(-1)
                continue
            try:
                row.append(int(part))
            except ValueError:
                raise _malformed(path, lineno, expected, line) from None
        rows.append(row)
    return np.asarray(rows, dtype=np.int64).reshape(-1, ncols)


def _check_values(
    path: Path, values: IntArray, lo: int, hi: int, what: str, first_line: int = 1
) -> None:
    bad = np.flatnonzero((values < lo) | (values > hi))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{path}, line {first_line + i}: {what} must be in {lo}..{hi}, got {values[i]}"
        )


def _check_ids(path: Path, values: IntArray, what: str, first_line: int = 1) -> None:
    _check_values(path, values, 1, np.iinfo(np.int64).max, what, first_line)


def _as_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(2, f"MovieLens file {p} does not exist", str(p))
    return p


# --------------------------------------------------------------------------------------------
# Parsers
# --------------------------------------------------------------------------------------------


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


def _check_unique(path: Path, ids: IntArray, what: str) -> None:
    _, first, counts = np.unique(ids, return_index=True, return_counts=True)
    if np.any(counts > 1):
        dup_val = ids[first[counts > 1][0]]
        line = int(np.flatnonzero(ids == dup_val)[1]) + 1
        raise ValueError(f"{path}, line {line}: duplicate {what} {dup_val}")


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


# --------------------------------------------------------------------------------------------
# Negative sampling
# --------------------------------------------------------------------------------------------


def sample_negatives(
    users: npt.ArrayLike,
    items: npt.ArrayLike,
    num_items: int,
    neg_ratio: int = 1,
    seed: int | np.random.SeedSequence | np.random.Generator = 0,
) -> tuple[IntArray, IntArray]:
    """Sample unrated (user, item) pairs uniformly, ``neg_ratio`` per rated pair of each user.

    For every user ``u`` with ``n_u`` distinct rated items, ``neg_ratio * n_u`` negatives are
    drawn independently and uniformly from the items ``u`` has not rated (so the same negative
    pair can occur more than once: with ``neg_ratio=1`` heavy ML-1M users have more ratings
    than unrated movies). Users who rated every item get no negatives. Sampling is vectorised
    rejection sampling, with an exact per-user fallback for the few draws still rejected after
    many rounds.

    Args:
        users: Dense user indices of the rated pairs, shape ``(N,)``, values ``>= 0``.
        items: Dense item indices of the rated pairs, shape ``(N,)``, in ``[0, num_items)``.
        num_items: Size of the item universe.
        neg_ratio: Negatives per rated pair (``>= 0``).
        seed: Seed, SeedSequence or Generator.

    Returns:
        ``(neg_users, neg_items)``, int64 arrays sorted by user, none of which is a rated pair.

    Raises:
        TypeError: If ``num_items`` or ``neg_ratio`` is not an int.
        ValueError: On mismatched shapes or out-of-range indices.
    """
    u = np.asarray(users, dtype=np.int64)
    it = np.asarray(items, dtype=np.int64)
    for name, val in (("num_items", num_items), ("neg_ratio", neg_ratio)):
        if isinstance(val, bool) or not isinstance(val, int | np.integer):
            raise TypeError(f"{name} must be an int, got {type(val).__name__}")
    if neg_ratio < 0:
        raise ValueError(f"neg_ratio must be >= 0, got {neg_ratio}")
    if num_items < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items}")
    if u.shape != it.shape or u.ndim != 1:
        raise ValueError(f"users and items must be 1-D of equal length, got {u.shape}, {it.shape}")
    if u.size and (u.min() < 0 or it.min() < 0 or it.max() >= num_items):
        raise ValueError("users must be >= 0 and items must be in [0, num_items)")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    keys = np.unique(u * num_items + it)
    num_users = int(u.max()) + 1 if u.size else 0
    n_pos = np.bincount(keys // num_items, minlength=num_users)
    want = n_pos * neg_ratio
    want[n_pos >= num_items] = 0
    neg_u = np.repeat(np.arange(num_users, dtype=np.int64), want)
    neg_i = np.empty_like(neg_u)
    pending = np.arange(neg_u.size)
    for _ in range(64):
        if pending.size == 0:
            break
        cand = rng.integers(0, num_items, size=pending.size)
        ck = neg_u[pending] * num_items + cand
        pos = np.searchsorted(keys, ck)
        hit = keys[np.minimum(pos, keys.size - 1)] == ck
        neg_i[pending[~hit]] = cand[~hit]
        pending = pending[hit]
    if pending.size:
        # Exact fallback for users who rated almost everything.
        for user in np.unique(neg_u[pending]):
            rows = pending[neg_u[pending] == user]
            rated = keys[(keys // num_items) == user] % num_items
            free = np.setdiff1d(np.arange(num_items), rated, assume_unique=True)
            neg_i[rows] = free[rng.integers(0, free.size, size=rows.size)]
    return neg_u, neg_i


# --------------------------------------------------------------------------------------------
# Two-task dataset
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MovieLensSplit:
    """One split of the two-task MovieLens dataset (all tensors have length ``N``).

    Attributes:
        user: int64 user index in ``[0, num_users)`` (for an embedding layer).
        item: int64 item index in ``[0, num_items)``.
        watched: float32 task-1 label: 1 for a rated pair, 0 for a sampled negative.
        rating: float32 task-2 label: the rating (1..5) for positives, ``negative_rating``
            for negatives.
        rating_mask: bool, True where ``rating`` is an observed rating (i.e. ``watched == 1``).
        user_age: int64 age bucket (0..6), or None without side features.
        user_gender: int64 gender (0 = M, 1 = F), or None.
        user_occupation: int64 occupation index, or None.
        item_genres: float32 multi-hot genres ``(N, num_genres)``, or None.
    """

    user: torch.Tensor
    item: torch.Tensor
    watched: torch.Tensor
    rating: torch.Tensor
    rating_mask: torch.Tensor
    user_age: torch.Tensor | None = None
    user_gender: torch.Tensor | None = None
    user_occupation: torch.Tensor | None = None
    item_genres: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.user.shape[0])

    def dataset(self) -> torch.utils.data.TensorDataset:
        """Return a TensorDataset of the non-None fields, in the order of the attributes above.

        That is ``(user, item, watched, rating, rating_mask)`` followed, with side features,
        by ``(user_age, user_gender, user_occupation, item_genres)``.
        """
        fields = [
            self.user, self.item, self.watched, self.rating, self.rating_mask,
            self.user_age, self.user_gender, self.user_occupation, self.item_genres,
        ]  # fmt: skip
        return torch.utils.data.TensorDataset(*[f for f in fields if f is not None])


@dataclass(frozen=True)
class MovieLensData:
    """The two-task MovieLens dataset: splits plus metadata.

    Attributes:
        train: Training split.
        val: Validation split.
        test: Test split.
        num_users: Number of users (users with at least one rating in the source).
        num_items: Number of items (movies with at least one rating in the source).
        num_age_buckets: 7 (see :data:`AGE_BUCKETS`).
        num_genders: 2.
        num_occupations: 21.
        num_genres: 19 (ML-100K, includes "unknown") or 18 (ML-1M).
        user_ids: Original user id of each user index, shape ``(num_users,)``.
        item_movie_ids: Original movie id of each item index (``-1`` if unresolved).
        user_age: int64 age bucket per user index (lookup table).
        user_gender: int64 gender per user index.
        user_occupation: int64 occupation per user index.
        item_genres: float32 multi-hot genres per item index, ``(num_items, num_genres)``.
        genre_names: Genre vocabulary.
        occupation_names: Occupation vocabulary.
        variant: ``"ml-100k"`` or ``"ml-1m"``.
        ratings_source: Which ratings file was used.
        num_ratings: Number of rated pairs (positives) in all splits together.
        neg_ratio: Negatives per positive.
        negative_rating: Rating label given to negatives.
        seed: The seed.
    """

    train: MovieLensSplit
    val: MovieLensSplit
    test: MovieLensSplit
    num_users: int
    num_items: int
    num_age_buckets: int
    num_genders: int
    num_occupations: int
    num_genres: int
    user_ids: IntArray
    item_movie_ids: IntArray
    user_age: torch.Tensor
    user_gender: torch.Tensor
    user_occupation: torch.Tensor
    item_genres: torch.Tensor
    genre_names: tuple[str, ...]
    occupation_names: tuple[str, ...]
    variant: str
    ratings_source: str
    num_ratings: int
    neg_ratio: int
    negative_rating: float
    seed: int


def _pick_ml1m_source(
    ratings_source: str, data_dir: str | os.PathLike[str] | None, download: bool
) -> tuple[str, Path]:
    if ratings_source != "auto":
        return ratings_source, fetch(_ML1M_FILES[ratings_source], data_dir, download)
    root = resolve_data_dir(data_dir)
    for src in ("ratings.dat", "no-timestamps", "users-0001-2999"):
        if (root / _ML1M_FILES[src]).is_file():
            return src, root / _ML1M_FILES[src]
    try:
        return "ratings.dat", fetch(_ML1M_FILES["ratings.dat"], data_dir, download)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            2,
            f"{exc.strerror} Alternatively, the partial forms "
            f"{_ML1M_FILES['no-timestamps']!r} or {_ML1M_FILES['users-0001-2999']!r} "
            f"are used when present in {root}; neither was found.",
            exc.filename,
        ) from exc


def _load_sources(
    variant: str, ratings_source: str, data_dir: str | os.PathLike[str] | None, download: bool
) -> tuple[str, Path, Ratings, Users, Items]:
    if variant == "ml-100k":
        if ratings_source not in ("auto", "u.data"):
            raise ValueError(
                f"ratings_source must be 'auto' or 'u.data' for ml-100k, got {ratings_source!r}"
            )
        path = fetch("movielens/ml-100k/u.data", data_dir, download)
        ratings = read_ml100k_ratings(path)
        users = read_ml100k_users(fetch("movielens/ml-100k/u.user", data_dir, download))
        items = read_ml100k_items(fetch("movielens/ml-100k/u.item", data_dir, download))
        return "u.data", path, ratings, users, items
    if ratings_source not in ML1M_RATINGS_SOURCES:
        raise ValueError(
            f"ratings_source must be one of {ML1M_RATINGS_SOURCES} for ml-1m, "
            f"got {ratings_source!r}"
        )
    src, path = _pick_ml1m_source(ratings_source, data_dir, download)
    if src == "no-timestamps":
        ratings = read_ml1m_ratings_no_timestamps(path)
    else:
        ratings = read_ml1m_ratings(path)
    users = read_ml1m_users(fetch("movielens/ml-1m/users.dat", data_dir, download))
    items = read_ml1m_movies(fetch("movielens/ml-1m/movies.dat", data_dir, download))
    return src, path, ratings, users, items


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


def _check_fractions(fractions: Sequence[float]) -> tuple[float, float, float]:
    if not isinstance(fractions, Sequence) or len(fractions) != 3:
        raise ValueError(f"fractions must be a (train, val, test) triple, got {fractions!r}")
    fr = tuple(float(f) for f in fractions)
    if any(f < 0 for f in fr) or abs(sum(fr) - 1.0) > 1e-6:
        raise ValueError(f"fractions must be non-negative and sum to 1, got {fractions!r}")
    return fr[0], fr[1], fr[2]


def load_movielens(
    data_dir: str | os.PathLike[str] | None = None,
    variant: str = "ml-100k",
    neg_ratio: int = 1,
    seed: int = 0,
    fractions: Sequence[float] = (0.8, 0.1, 0.1),
    negative_rating: float = 0.0,
    side_features: bool = True,
    ratings_source: str = "auto",
    download: bool = True,
) -> MovieLensData:
    """Build the two-task (watch, rating) MovieLens dataset of the paper.

    Users and items are re-indexed densely (``0..num_users-1``, ``0..num_items-1``) in
    increasing original-id order; only users and movies with at least one rating are indexed
    (movies never rated would only ever be negatives). Negatives are sampled from the full
    rating data before splitting (see :func:`sample_negatives`), so every negative in every
    split is a pair the user never rated. Positives and negatives are then shuffled together
    and split by ``fractions`` (the paper's ML-1M split is 0.8 / 0.1 / 0.1 of 2M examples).

    Args:
        data_dir: Data directory; see :func:`dselectk.data.resolve_data_dir`.
        variant: ``"ml-100k"`` or ``"ml-1m"``.
        neg_ratio: Negatives per rating (``>= 0``).
        seed: Seed for negative sampling and the split; results are deterministic given it.
        fractions: ``(train, val, test)`` fractions summing to 1. Split sizes are
            ``round(N * val)`` and ``round(N * test)``, train gets the rest.
        negative_rating: Task-2 label for negatives (the paper is silent; 0 by default). Use
            :attr:`MovieLensSplit.rating_mask` to ignore negatives in the rating loss instead.
        side_features: Whether to attach per-example user age bucket, gender, occupation and
            movie genres to each split (the lookup tables are always in the result).
        ratings_source: ML-1M only: ``"auto"`` (``ratings.dat`` if present, else
            ``ratings_no_timestamps.csv.gz``, else ``ratings_users_0001-2999.dat``, else
            download ``ratings.dat``), or one of ``"ratings.dat"``, ``"no-timestamps"``,
            ``"users-0001-2999"``. For ML-100K only ``"auto"``/``"u.data"``.
        download: Whether missing files may be downloaded.

    Returns:
        A :class:`MovieLensData`.

    Raises:
        TypeError: If ``neg_ratio`` or ``seed`` is not an int.
        ValueError: On bad arguments, malformed files, duplicate (user, movie) ratings or rated
            users/movies missing from the side-information files.
        FileNotFoundError: If required files are missing and cannot be downloaded.
    """
    if variant not in MOVIELENS_VARIANTS:
        raise ValueError(f"variant must be one of {MOVIELENS_VARIANTS}, got {variant!r}")
    for name, val in (("neg_ratio", neg_ratio), ("seed", seed)):
        if isinstance(val, bool) or not isinstance(val, int | np.integer):
            raise TypeError(f"{name} must be an int, got {type(val).__name__}")
        if val < 0:
            raise ValueError(f"{name} must be >= 0, got {val}")
    fr = _check_fractions(fractions)
    negative_rating = float(negative_rating)

    src, path, ratings, users, items = _load_sources(variant, ratings_source, data_dir, download)

    user_ids, pos_u = np.unique(ratings.user, return_inverse=True)
    pos_u = pos_u.astype(np.int64)
    pos_i, item_movie_ids, num_items = _item_keys(path, ratings, data_dir)
    num_users = int(user_ids.size)

    pair = pos_u * num_items + pos_i
    uniq, counts = np.unique(pair, return_counts=True)
    if np.any(counts > 1):
        dup = int(uniq[counts > 1][0])
        line = int(np.flatnonzero(pair == dup)[1]) + (2 if src == "no-timestamps" else 1)
        raise ValueError(
            f"{path}, line {line}: duplicate rating of movie {item_movie_ids[dup % num_items]} "
            f"by user {user_ids[dup // num_items]}"
        )

    # User side-information tables (per dense user index).
    order = np.argsort(users.ids)
    upos = np.searchsorted(users.ids, user_ids, sorter=order)
    upos = np.minimum(upos, users.ids.size - 1)
    found = users.ids[order[upos]] == user_ids if users.ids.size else np.zeros(0, bool)
    if not np.all(found):
        missing = user_ids[~found][0] if users.ids.size else user_ids[0]
        raise ValueError(f"user {missing} has ratings in {path} but is missing from users file")
    urow = order[upos]
    # Item genre table; unresolved movie ids (-1) get all-zero genres.
    iorder = np.argsort(items.ids)
    resolved = item_movie_ids >= 0
    ipos = np.searchsorted(items.ids, item_movie_ids, sorter=iorder)
    ipos = np.minimum(ipos, max(items.ids.size - 1, 0))
    ifound = np.zeros(num_items, dtype=bool)
    if items.ids.size:
        ifound = items.ids[iorder[ipos]] == item_movie_ids
    if np.any(resolved & ~ifound):
        missing = item_movie_ids[resolved & ~ifound][0]
        raise ValueError(f"movie {missing} has ratings in {path} but is missing from movies file")
    genre_table = np.zeros((num_items, len(items.genre_names)), dtype=np.float32)
    genre_table[resolved] = items.genres[iorder[ipos[resolved]]]

    ss_neg, ss_split = np.random.SeedSequence(int(seed)).spawn(2)
    neg_u, neg_i = sample_negatives(pos_u, pos_i, num_items, int(neg_ratio), ss_neg)

    all_u = np.concatenate([pos_u, neg_u])
    all_i = np.concatenate([pos_i, neg_i])
    watched = np.concatenate([np.ones(pos_u.size, np.float32), np.zeros(neg_u.size, np.float32)])
    rating = np.concatenate(
        [ratings.rating.astype(np.float32), np.full(neg_u.size, negative_rating, np.float32)]
    )
    n = all_u.size
    perm = np.random.default_rng(ss_split).permutation(n)
    n_val, n_test = round(n * fr[1]), round(n * fr[2])
    n_train = n - n_val - n_test
    bounds = {"train": perm[:n_train], "val": perm[n_train : n_train + n_val],
              "test": perm[n_train + n_val :]}  # fmt: skip

    user_age = torch.from_numpy(users.age[urow].copy())
    user_gender = torch.from_numpy(users.gender[urow].copy())
    user_occ = torch.from_numpy(users.occupation[urow].copy())
    item_genres = torch.from_numpy(genre_table)

    def make(idx: IntArray) -> MovieLensSplit:
        u_t = torch.from_numpy(all_u[idx])
        i_t = torch.from_numpy(all_i[idx])
        w_t = torch.from_numpy(watched[idx])
        return MovieLensSplit(
            user=u_t,
            item=i_t,
            watched=w_t,
            rating=torch.from_numpy(rating[idx]),
            rating_mask=w_t > 0.5,
            user_age=user_age[u_t] if side_features else None,
            user_gender=user_gender[u_t] if side_features else None,
            user_occupation=user_occ[u_t] if side_features else None,
            item_genres=item_genres[i_t] if side_features else None,
        )

    return MovieLensData(
        train=make(bounds["train"]),
        val=make(bounds["val"]),
        test=make(bounds["test"]),
        num_users=num_users,
        num_items=num_items,
        num_age_buckets=len(AGE_BUCKETS),
        num_genders=len(_GENDERS),
        num_occupations=len(users.occupation_names),
        num_genres=len(items.genre_names),
        user_ids=user_ids.astype(np.int64),
        item_movie_ids=item_movie_ids,
        user_age=user_age,
        user_gender=user_gender,
        user_occupation=user_occ,
        item_genres=item_genres,
        genre_names=items.genre_names,
        occupation_names=users.occupation_names,
        variant=variant,
        ratings_source=src,
        num_ratings=int(pos_u.size),
        neg_ratio=int(neg_ratio),
        negative_rating=negative_rating,
        seed=int(seed),
    )
