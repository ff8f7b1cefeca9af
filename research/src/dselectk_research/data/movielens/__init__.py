"""MovieLens parsers and the two-task recommendation dataset of the DSelect-k paper.

Package layout (everything public is re-exported here):

* :mod:`~dselectk_research.data.movielens.schema`: vocabularies and the parsed-file containers.
* :mod:`~dselectk_research.data.movielens.parse`: parsers of the raw ML-100K / ML-1M files,
including
  the partial ML-1M forms (helpers in :mod:`~dselectk_research.data.movielens._text`).
* :mod:`~dselectk_research.data.movielens.negatives`: negative sampling (implicit feedback).
* :mod:`~dselectk_research.data.movielens.sources`: which files a variant is built from.
* :mod:`~dselectk_research.data.movielens.dataset`: splits, tensors and :func:`load_movielens`.

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

With ``ratings_source="auto"`` a partial form is used only when ``ratings.dat`` is absent, and
then with a :class:`~dselectk_research.data.PartialDataWarning` naming the form and its number of
users;
name the form (``ratings_source="no-timestamps"`` / ``"users-0001-2999"``) to use it without the
warning.
All these files are verified against the checksums of ``shared/data/PROVENANCE.md`` on first
use (see :func:`dselectk_research.data.fetch`).
"""

from dselectk_research.data.movielens.dataset import MovieLensData, MovieLensSplit, load_movielens
from dselectk_research.data.movielens.negatives import sample_negatives
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
from dselectk_research.data.movielens.schema import (
    AGE_BUCKETS,
    ML1M_GENRES,
    ML1M_OCCUPATIONS,
    ML100K_GENRES,
    ML100K_OCCUPATIONS,
    IntArray,
    ItemIndexMap,
    Items,
    Ratings,
    Users,
)
from dselectk_research.data.movielens.sources import ML1M_RATINGS_SOURCES, MOVIELENS_VARIANTS

__all__ = [
    "AGE_BUCKETS",
    "ML1M_GENRES",
    "ML1M_OCCUPATIONS",
    "ML1M_RATINGS_SOURCES",
    "ML100K_GENRES",
    "ML100K_OCCUPATIONS",
    "MOVIELENS_VARIANTS",
    "IntArray",
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
