"""MovieLens vocabularies and the containers the parsers return.

* Vocabularies: genre names (:data:`ML100K_GENRES`, :data:`ML1M_GENRES`), occupation names
  (:data:`ML100K_OCCUPATIONS`, :data:`ML1M_OCCUPATIONS`) and the seven age buckets
  (:data:`AGE_BUCKETS`) shared by ML-100K and ML-1M.
* Containers: :class:`Ratings`, :class:`Users`, :class:`Items` and :class:`ItemIndexMap`, the
  parsed contents of the raw files (see :mod:`dselectk_research.data.movielens.parse`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]

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
