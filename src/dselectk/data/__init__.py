"""Loaders for the datasets used in the DSelect-k paper.

* MNIST / Fashion-MNIST from the official IDX files, and the Multi-MNIST /
  Multi-Fashion-MNIST two-task datasets (paper Section 4.2, Appendix D.2).
* MovieLens 100K / 1M parsers and the two-task (watch, rating) dataset (paper Section 4.1).

Files are looked up in a data directory (``data_dir`` argument > ``$DSELECTK_DATA`` >
``~/.cache/dselectk``) with the upstream layout (``mnist/``, ``fashion-mnist/``,
``movielens/ml-100k/``, ``movielens/ml-1m/``) and downloaded there, checksummed, when missing.
"""

from dselectk.data._files import (
    DATA_ENV_VAR,
    DEFAULT_DATA_DIR,
    ChecksumError,
    fetch,
    known_files,
    resolve_data_dir,
)
from dselectk.data.mnist import (
    MNIST_KINDS,
    MultiMNISTData,
    MultiTaskImages,
    load_mnist,
    load_multi_mnist,
    make_multi_mnist,
    read_idx,
)
from dselectk.data.movielens import (
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

__all__ = [
    "AGE_BUCKETS",
    "DATA_ENV_VAR",
    "DEFAULT_DATA_DIR",
    "ML1M_RATINGS_SOURCES",
    "MNIST_KINDS",
    "MOVIELENS_VARIANTS",
    "ChecksumError",
    "ItemIndexMap",
    "Items",
    "MovieLensData",
    "MovieLensSplit",
    "MultiMNISTData",
    "MultiTaskImages",
    "Ratings",
    "Users",
    "fetch",
    "known_files",
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
]
