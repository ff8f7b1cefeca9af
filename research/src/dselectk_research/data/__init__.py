"""Loaders for the datasets used in the DSelect-k paper.

* MNIST / Fashion-MNIST from the official IDX files, and the Multi-MNIST /
  Multi-Fashion-MNIST two-task datasets (paper Section 4.2, Appendix D.2).
* MovieLens 100K / 1M parsers and the two-task (watch, rating) dataset (paper Section 4.1).
* A byte-stream text corpus (:mod:`~dselectk_research.data.text`: the Python standard library's
source)
  for byte-level language models; nothing to download.

Files are looked up in a data directory (``data_dir`` argument > ``$DSELECTK_DATA`` >
``~/.cache/dselectk``) with the upstream layout (``mnist/``, ``fashion-mnist/``,
``movielens/ml-100k/``, ``movielens/ml-1m/``) and downloaded there, checksummed, when missing.

Local files are verified too: every file the registry knows (:func:`verified_files`: the
upstream files and the partial ML-1M forms of ``shared/data``) is checked against its known size
and SHA-256 on every use (its content is read, nothing is trusted from its size or timestamp),
so a truncated ``u.data`` or Fashion-MNIST files under ``mnist/`` raise :class:`ChecksumError`
instead of loading. Files the registry does not know are used with one warning. Pass
``verify=False`` to a loader (or set ``DSELECTK_VERIFY=0``) to use your own copies as they are.

:func:`fingerprint` gives a short stable hash of data files (names and contents); the loaders
report it for the files they read (``MovieLensData.fingerprint``,
``MultiMNISTData.fingerprint``), for run records to carry.
"""

from dselectk_research.data._files import (
    DATA_ENV_VAR,
    DEFAULT_DATA_DIR,
    ChecksumError,
    fetch,
    known_files,
    resolve_data_dir,
    verified_files,
)
from dselectk_research.data._integrity import VERIFY_ENV_VAR, PartialDataWarning, fingerprint
from dselectk_research.data.mnist import (
    MNIST_KINDS,
    MultiMNISTData,
    MultiTaskImages,
    load_mnist,
    load_multi_mnist,
    make_multi_mnist,
    read_idx,
)
from dselectk_research.data.movielens import (
    AGE_BUCKETS,
    ML1M_RATINGS_SOURCES,
    MOVIELENS_VARIANTS,
    ItemIndexMap,
    Items,
    MovieLensData,
    MovieLensSplit,
    Ratings,
    Users,
    load_movielens,
    read_ml1m_item_index_map,
    read_ml1m_movies,
    read_ml1m_ratings,
    read_ml1m_ratings_no_timestamps,
    read_ml1m_users,
    read_ml100k_items,
    read_ml100k_ratings,
    read_ml100k_users,
    sample_negatives,
)
from dselectk_research.data.text import Corpus, load_corpus

__all__ = [
    "AGE_BUCKETS",
    "DATA_ENV_VAR",
    "DEFAULT_DATA_DIR",
    "ML1M_RATINGS_SOURCES",
    "MNIST_KINDS",
    "MOVIELENS_VARIANTS",
    "VERIFY_ENV_VAR",
    "ChecksumError",
    "Corpus",
    "ItemIndexMap",
    "Items",
    "MovieLensData",
    "MovieLensSplit",
    "MultiMNISTData",
    "MultiTaskImages",
    "PartialDataWarning",
    "Ratings",
    "Users",
    "fetch",
    "fingerprint",
    "known_files",
    "load_corpus",
    "load_mnist",
    "load_movielens",
    "load_multi_mnist",
    "make_multi_mnist",
    "read_idx",
    "read_ml1m_item_index_map",
    "read_ml1m_movies",
    "read_ml1m_ratings",
    "read_ml1m_ratings_no_timestamps",
    "read_ml1m_users",
    "read_ml100k_items",
    "read_ml100k_ratings",
    "read_ml100k_users",
    "resolve_data_dir",
    "sample_negatives",
    "verified_files",
]
