"""The two-task (watch, rating) MovieLens dataset: splits, tensors and :func:`load_movielens`.

:func:`load_movielens` reads a variant's files (:mod:`dselectk_research.data.movielens.sources`),
re-indexes users and items densely, attaches the side-information tables, samples negatives
(:mod:`dselectk_research.data.movielens.negatives`), shuffles and splits into
:class:`MovieLensSplit` train / validation / test tensors, returned in a :class:`MovieLensData`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dselectk_research.data._integrity import fingerprint
from dselectk_research.data.movielens.negatives import sample_negatives
from dselectk_research.data.movielens.schema import _GENDERS, AGE_BUCKETS, IntArray
from dselectk_research.data.movielens.sources import MOVIELENS_VARIANTS, _item_keys, _load_sources


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
        fingerprint: Short stable hash of the files read (see
        :func:`dselectk_research.data.fingerprint`:
            names and SHA-256 of the files, not their folder). Store it with results; a
            different value means different data.
        files: Paths of the files read (ratings, users, movies, and for the no-timestamps form
            the ItemIndex map when present).
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
    fingerprint: str = ""
    files: tuple[str, ...] = ()


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
    verify: bool | None = None,
) -> MovieLensData:
    """Build the two-task (watch, rating) MovieLens dataset of the paper.

    Users and items are re-indexed densely (``0..num_users-1``, ``0..num_items-1``) in
    increasing original-id order; only users and movies with at least one rating are indexed
    (movies never rated would only ever be negatives). Negatives are sampled from the full
    rating data before splitting (see :func:`sample_negatives`), so every negative in every
    split is a pair the user never rated. Positives and negatives are then shuffled together
    and split by ``fractions`` (the paper's ML-1M split is 0.8 / 0.1 / 0.1 of 2M examples).

    Args:
        data_dir: Data directory; see :func:`dselectk_research.data.resolve_data_dir`.
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
            ``"users-0001-2999"``. A partial form is used silently only when named here;
            picked by ``"auto"`` it gives a :class:`~dselectk_research.data.PartialDataWarning`
            naming
            the form and its number of users. For ML-100K only ``"auto"``/``"u.data"``.
        download: Whether missing files may be downloaded.
        verify: Whether local files are checked against their known checksums (their
            content, read on every load). None: yes, unless ``$DSELECTK_VERIFY`` is ``0``.
            Pass False to use your own copies of the files as they are.

    Returns:
        A :class:`MovieLensData`.

    Raises:
        TypeError: If ``neg_ratio`` or ``seed`` is not an int.
        ValueError: On bad arguments, malformed files, duplicate (user, movie) ratings or rated
            users/movies missing from the side-information files.
        FileNotFoundError: If required files are missing and cannot be downloaded.
        ChecksumError: If a local file is not the known file (e.g. a truncated ``u.data``);
            the message names it and says what to do.
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

    src, path, ratings, users, items, files = _load_sources(
        variant, ratings_source, data_dir, download, verify
    )
    data_fingerprint = fingerprint(files)

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
        fingerprint=data_fingerprint,
        files=tuple(str(f) for f in files),
    )
