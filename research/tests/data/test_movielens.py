"""Tests for the MovieLens parsers, negative sampling and the two-task dataset."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from datahelpers import write_ml1m, write_ml100k

from dselectk_research.data import (
    MovieLensData,
    MovieLensSplit,
    PartialDataWarning,
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

SPLITS = ("train", "val", "test")


def _all(d: MovieLensData) -> dict[str, np.ndarray]:
    """Concatenate the three splits (original ids, labels)."""
    parts = [getattr(d, s) for s in SPLITS]
    user = torch.cat([p.user for p in parts]).numpy()
    item = torch.cat([p.item for p in parts]).numpy()
    return {
        "user_id": d.user_ids[user],
        "movie_id": d.item_movie_ids[item],
        "user": user,
        "item": item,
        "watched": torch.cat([p.watched for p in parts]).numpy(),
        "rating": torch.cat([p.rating for p in parts]).numpy(),
        "mask": torch.cat([p.rating_mask for p in parts]).numpy(),
    }


# ---------------------------------------------------------------- parsers


def test_ml100k_parsers(tmp_path: Path) -> None:
    d, ratings = write_ml100k(tmp_path)
    r = read_ml100k_ratings(d / "u.data")
    assert len(r) == len(ratings)
    np.testing.assert_array_equal(np.stack([r.user, r.movie, r.rating], 1), ratings)
    assert r.timestamp is not None and r.item_index is None
    u = read_ml100k_users(d / "u.user")
    assert u.ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert u.age.tolist() == [0, 1, 2, 3, 4, 6]  # ages 7, 18, 30, 44, 49, 70 -> buckets
    assert u.gender.tolist() == [1, 0, 1, 0, 1, 0]  # 'MF'[u % 2]
    assert [u.occupation_names[o] for o in u.occupation] == [
        "artist",
        "doctor",
        "student",
        "writer",
        "administrator",
        "artist",
    ]
    it = read_ml100k_items(d / "u.item")
    assert it.genres.shape == (9, 19) and it.genres.sum() == 9
    assert it.genres[0, 1] == 1 and it.titles[0] == "Caf\xe9 1 (1995)"  # Latin-1 decoded


def test_ml1m_parsers(tmp_path: Path) -> None:
    d, ratings = write_ml1m(tmp_path)
    r = read_ml1m_ratings(d / "ratings.dat")
    np.testing.assert_array_equal(np.stack([r.user, r.movie, r.rating], 1), ratings)
    part = read_ml1m_ratings(d / "ratings_users_0001-2999.dat")
    assert len(part) == int((ratings[:, 0] <= 4).sum()) and part.user.max() <= 4
    nt = read_ml1m_ratings_no_timestamps(d / "ratings_no_timestamps.csv.gz")
    assert len(nt) == len(ratings) and nt.timestamp is None and nt.item_index is not None
    assert set(nt.movie[nt.item_index == 8].tolist()) == {-1}  # unresolved
    assert nt.movie[nt.item_index == 1].tolist() == [10] * int((nt.item_index == 1).sum())
    m = read_ml1m_item_index_map(d / "item_index_to_movieid.csv")
    assert m.movie.tolist() == [10, 20, 30, 40, 50, 60, 70, -1]
    assert m.candidates[-1] == (79, 80) and m.candidates[0] == ()
    us = read_ml1m_users(d / "users.dat")
    assert us.age.tolist() == list(range(7)) and us.occupation.tolist() == [2, 4, 6, 8, 10, 12, 14]
    mv = read_ml1m_movies(d / "movies.dat")
    assert mv.ids.tolist() == [10, 20, 30, 40, 50, 60, 70, 80, 85]
    assert mv.genres.shape == (9, 18)
    assert [mv.genre_names[g] for g in np.flatnonzero(mv.genres[1])] == ["Comedy", "Drama"]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("reader", "text", "line", "what"),
    [
        (read_ml100k_ratings, "1\t1\t5\t0\n2\t1\t4\t0\n3\t1\t4\n", 3, "malformed"),
        (read_ml100k_ratings, "1\t1\t5\t0\n2\tx\t4\t0\n", 2, "malformed"),
        (read_ml100k_ratings, "1\t1\t5\t0\n\n2\t1\t4\t0\n", 2, "malformed"),
        (read_ml100k_ratings, "1\t1\t5\t0\n2\t1\t7\t0\n", 2, "rating"),
        (read_ml100k_ratings, "1\t1\t5\t0\n2\t0\t4\t0\n", 2, "item id"),
        (read_ml1m_ratings, "1::1::5::0\n1::2::5\n", 2, "malformed"),
        (read_ml1m_ratings, "1::1::5::0\n1::2:5::0\n", 2, "malformed"),
        (read_ml1m_ratings, "1::1::5::0\n1::2::5::0::9\n", 2, "malformed"),
        (read_ml1m_ratings, "1::1::5::0\n1::2::5::0\n1::3::0::0\n", 3, "Rating"),
        (read_ml1m_ratings_no_timestamps, "UserID,MovieID,Rating,ItemIndex\n1,1,5\n", 2, "malf"),
        (read_ml1m_ratings_no_timestamps, "UserID,MovieID,Rating,ItemIndex\n1,,6,1\n", 2, "Rat"),
        (read_ml1m_ratings_no_timestamps, "User,Movie\n1,1,5,1\n", 1, "header"),
        (read_ml100k_users, "1|24|M|technician|85711\n2|53|X|other|94043\n", 2, "malformed"),
        (read_ml100k_users, "1|24|M|technician|85711\n2|53|F|astronaut|94043\n", 2, "malf"),
        (read_ml100k_users, "1|24|M|technician|85711\n1|53|F|other|94043\n", 2, "duplicate"),
        (read_ml1m_users, "1::F::1::10::48067\n2::M::17::16::70072\n", 2, "malformed"),
        (read_ml1m_users, "1::F::1::10::48067\n2::M::56::21::70072\n", 2, "malformed"),
        (read_ml1m_movies, "1::Toy Story (1995)::Animation\n2::Jumanji::Cooking\n", 2, "malf"),
        (read_ml1m_movies, "1::Toy Story (1995)::Animation\n2::Jumanji\n", 2, "malformed"),
        (read_ml100k_items, "1|T|d||u|" + "|".join("0" * 19) + "\n2|T|d||u|0|1\n", 2, "malf"),
        (read_ml1m_item_index_map, "ItemIndex,MovieID,CandidateMovieIDs\n1,,\n", 2, "malf"),
    ],
)
def test_malformed_line_names_file_and_line(
    tmp_path: Path, reader: object, text: str, line: int, what: str
) -> None:
    path = _write(tmp_path / "file.txt", text)
    with pytest.raises(ValueError, match=rf"line {line}\b.*") as info:
        reader(path)  # type: ignore[operator]
    msg = str(info.value)
    assert str(path) in msg
    assert what in msg


def test_gzip_and_crlf_accepted(tmp_path: Path) -> None:
    p = tmp_path / "ratings.dat.gz"
    p.write_bytes(gzip.compress(b"1::10::5::0\r\n2::10::3::1\r\n"))
    r = read_ml1m_ratings(p)
    assert r.user.tolist() == [1, 2] and r.rating.tolist() == [5, 3]


def test_parser_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"u\.data"):
        read_ml100k_ratings(tmp_path / "u.data")


# ---------------------------------------------------------------- sample_negatives


def test_sample_negatives_unrated_and_counts() -> None:
    rng = np.random.default_rng(0)
    rated = rng.random((30, 40)) < 0.3
    rated[:, 0] = True
    rated[3] = True  # user 3 rated everything: no negatives possible
    rated[4] = True
    rated[4, 17] = False  # user 4: a single unrated item (exercises the exact fallback)
    u, i = np.nonzero(rated)
    nu, ni = sample_negatives(u, i, 40, neg_ratio=2, seed=1)
    assert not rated[nu, ni].any()  # every negative is an unrated pair
    counts = np.bincount(nu, minlength=30)
    expected = 2 * rated.sum(1)
    expected[3] = 0
    np.testing.assert_array_equal(counts, expected)
    assert set(ni[nu == 4].tolist()) == {17}
    a = sample_negatives(u, i, 40, 2, seed=1)
    np.testing.assert_array_equal(a[1], ni)
    assert not np.array_equal(sample_negatives(u, i, 40, 2, seed=2)[1], ni)


def test_sample_negatives_uniform() -> None:
    # One user who rated items 0..4 of 10: negatives uniform over 5..9.
    u = np.zeros(5, np.int64)
    i = np.arange(5)
    _, ni = sample_negatives(u, i, 10, neg_ratio=4000, seed=0)
    freq = np.bincount(ni, minlength=10) / ni.size
    assert freq[:5].sum() == 0
    np.testing.assert_allclose(freq[5:], 0.2, atol=0.02)


def test_sample_negatives_validation() -> None:
    with pytest.raises(ValueError, match="neg_ratio"):
        sample_negatives([0], [0], 3, -1)
    with pytest.raises(TypeError, match="neg_ratio"):
        sample_negatives([0], [0], 3, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_items"):
        sample_negatives([0], [3], 3)
    with pytest.raises(ValueError, match="equal length"):
        sample_negatives([0, 1], [0], 3)


# ---------------------------------------------------------------- load_movielens


def test_load_ml100k_tiny(tmp_path: Path) -> None:
    _, ratings = write_ml100k(tmp_path)
    d = load_movielens(tmp_path, "ml-100k", neg_ratio=1, seed=0, download=False, verify=False)
    assert d.num_users == 6 and d.num_items == 9 and d.num_ratings == len(ratings)
    assert (d.num_age_buckets, d.num_genders, d.num_occupations, d.num_genres) == (7, 2, 21, 19)
    a = _all(d)
    n_pos = len(ratings)
    assert a["watched"].sum() == n_pos and len(a["watched"]) == 2 * n_pos  # neg_ratio 1
    rated = {(int(u), int(m)) for u, m, _ in ratings}
    pos = a["watched"] == 1
    # Positives are exactly the rated pairs, with their ratings.
    got = sorted(zip(a["user_id"][pos].tolist(), a["movie_id"][pos].tolist(), strict=True))
    assert got == sorted(rated)
    lookup = {(int(u), int(m)): int(r) for u, m, r in ratings}
    for u, m, r in zip(a["user_id"][pos], a["movie_id"][pos], a["rating"][pos], strict=True):
        assert lookup[(int(u), int(m))] == r
    # Negatives are truly unrated pairs, with rating label 0 and mask False.
    for u, m in zip(a["user_id"][~pos], a["movie_id"][~pos], strict=True):
        assert (int(u), int(m)) not in rated
    assert np.all(a["rating"][~pos] == 0.0)
    np.testing.assert_array_equal(a["mask"], pos)
    # User 1 rated 8 of 9 items: all its negatives are item 9.
    assert set(a["movie_id"][~pos & (a["user_id"] == 1)].tolist()) == {9}


def test_load_movielens_split_sizes_and_side_features(tmp_path: Path) -> None:
    write_ml100k(tmp_path, n_users=20, n_items=30)
    d = load_movielens(
        tmp_path, neg_ratio=2, fractions=(0.6, 0.25, 0.15), download=False, verify=False
    )
    n = 3 * d.num_ratings
    sizes = [len(getattr(d, s)) for s in SPLITS]
    assert sizes[1] == round(0.25 * n) and sizes[2] == round(0.15 * n) and sum(sizes) == n
    for s in SPLITS:
        sp: MovieLensSplit = getattr(d, s)
        assert sp.user.dtype == torch.int64 and sp.item.dtype == torch.int64
        assert sp.watched.dtype == torch.float32 and sp.rating.dtype == torch.float32
        assert sp.rating_mask.dtype == torch.bool
        assert sp.user_age is not None and sp.item_genres is not None
        assert sp.user_gender is not None and sp.user_occupation is not None
        assert torch.equal(sp.user_age, d.user_age[sp.user])
        assert torch.equal(sp.user_gender, d.user_gender[sp.user])
        assert torch.equal(sp.user_occupation, d.user_occupation[sp.user])
        assert torch.equal(sp.item_genres, d.item_genres[sp.item])
        assert sp.item_genres.shape == (len(sp), 19)
        assert len(sp.dataset()[0]) == 9
    bare = load_movielens(tmp_path, neg_ratio=2, side_features=False, download=False, verify=False)
    assert bare.train.user_age is None and len(bare.train.dataset()[0]) == 5


def test_load_movielens_deterministic(tmp_path: Path) -> None:
    write_ml100k(tmp_path, n_users=15, n_items=25)
    a = load_movielens(tmp_path, seed=3, download=False, verify=False)
    b = load_movielens(tmp_path, seed=3, download=False, verify=False)
    c = load_movielens(tmp_path, seed=4, download=False, verify=False)
    for s in SPLITS:
        for f in ("user", "item", "watched", "rating", "rating_mask"):
            assert torch.equal(getattr(getattr(a, s), f), getattr(getattr(b, s), f))
    assert not torch.equal(a.train.item, c.train.item)


def test_load_movielens_options(tmp_path: Path) -> None:
    write_ml100k(tmp_path)
    d = load_movielens(tmp_path, neg_ratio=3, negative_rating=-1.0, download=False, verify=False)
    a = _all(d)
    neg = a["watched"] == 0
    assert neg.sum() == 3 * d.num_ratings
    assert np.all(a["rating"][neg] == -1.0) and d.negative_rating == -1.0
    d0 = load_movielens(tmp_path, neg_ratio=0, download=False, verify=False)
    assert _all(d0)["watched"].min() == 1.0
    with pytest.raises(ValueError, match="variant"):
        load_movielens(tmp_path, "ml-20m")
    with pytest.raises(ValueError, match="fractions"):
        load_movielens(tmp_path, fractions=(0.5, 0.5, 0.5))
    with pytest.raises(TypeError, match="neg_ratio"):
        load_movielens(tmp_path, neg_ratio=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ratings_source"):
        load_movielens(tmp_path, ratings_source="no-timestamps")


def test_load_movielens_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"movielens/ml-100k/u\.data"):
        load_movielens(tmp_path, download=False, verify=False)
    with pytest.raises(FileNotFoundError, match="partial forms") as info:
        load_movielens(tmp_path, "ml-1m", download=False, verify=False)
    assert "ratings_no_timestamps.csv.gz" in str(info.value)


def test_load_movielens_rated_user_missing_from_users(tmp_path: Path) -> None:
    d, _ = write_ml100k(tmp_path)
    lines = (d / "u.user").read_text().splitlines()
    (d / "u.user").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(ValueError, match=r"user 6 .* missing from users file"):
        load_movielens(tmp_path, download=False, verify=False)


def test_load_movielens_duplicate_rating(tmp_path: Path) -> None:
    d, _ = write_ml100k(tmp_path)
    text = (d / "u.data").read_text()
    first = text.splitlines()[0]
    (d / "u.data").write_text(text + first + "\n")
    with pytest.raises(ValueError, match="duplicate rating") as info:
        load_movielens(tmp_path, download=False, verify=False)
    assert f"line {len(text.splitlines()) + 1}" in str(info.value)


@pytest.mark.parametrize("source", ["ratings.dat", "no-timestamps", "users-0001-2999"])
def test_load_ml1m_sources(tmp_path: Path, source: str) -> None:
    _, ratings = write_ml1m(tmp_path)
    d = load_movielens(tmp_path, "ml-1m", ratings_source=source, download=False, verify=False)
    assert d.ratings_source == source and d.num_genres == 18
    keep = ratings[:, 0] <= 4 if source == "users-0001-2999" else np.ones(len(ratings), bool)
    assert d.num_ratings == int(keep.sum())
    assert d.num_users == len(np.unique(ratings[keep, 0]))
    a = _all(d)
    pos = a["watched"] == 1
    rated = {(int(u), int(m)) for u, m, _ in ratings}
    for u, i in zip(a["user"][~pos], a["item"][~pos], strict=True):
        movie = int(d.item_movie_ids[i])
        key_movie = 80 if movie == -1 else movie
        assert (int(d.user_ids[u]), key_movie) not in rated
    if source == "no-timestamps":
        # Movie 80 is unresolved: kept as an item with id -1 and no genres.
        assert d.num_items == 8 and d.item_movie_ids[-1] == -1
        assert float(d.item_genres[-1].sum()) == 0.0
        assert int((a["movie_id"][pos] == -1).sum()) == int((ratings[:, 1] == 80).sum())
    if source == "ratings.dat":
        assert d.item_movie_ids.tolist() == [10, 20, 30, 40, 50, 60, 70, 80]
    # Item indices agree across sources (ItemIndex follows MovieID order).
    if source != "users-0001-2999":
        assert d.num_items == 8
        assert float(d.item_genres[1].sum()) == 2.0  # movie 20: Comedy|Drama


def test_load_ml1m_auto_priority(tmp_path: Path) -> None:
    d, _ = write_ml1m(tmp_path)
    assert (
        load_movielens(tmp_path, "ml-1m", download=False, verify=False).ratings_source
        == "ratings.dat"
    )
    (d / "ratings.dat").unlink()
    with pytest.warns(PartialDataWarning, match="'no-timestamps'.*7 users"):
        assert (
            load_movielens(tmp_path, "ml-1m", download=False, verify=False).ratings_source
            == "no-timestamps"
        )
    (d / "ratings_no_timestamps.csv.gz").unlink()
    with pytest.warns(PartialDataWarning, match="'users-0001-2999'.*4 users"):
        got = load_movielens(tmp_path, "ml-1m", download=False, verify=False).ratings_source
    assert got == "users-0001-2999"


def test_load_ml1m_item_map_mismatch(tmp_path: Path) -> None:
    d, _ = write_ml1m(tmp_path)
    text = (d / "item_index_to_movieid.csv").read_text().replace("\n2,20,\n", "\n2,21,\n")
    (d / "item_index_to_movieid.csv").write_text(text)
    with pytest.raises(ValueError, match="disagrees"):
        load_movielens(
            tmp_path, "ml-1m", ratings_source="no-timestamps", download=False, verify=False
        )


# ---------------------------------------------------------------- real data


@pytest.mark.data
def test_real_ml100k(real_data: Path) -> None:
    d = load_movielens(real_data, "ml-100k", download=False)
    assert (d.num_users, d.num_items, d.num_ratings) == (943, 1682, 100_000)
    sizes = [len(getattr(d, s)) for s in SPLITS]
    assert sizes == [160_000, 20_000, 20_000]
    a = _all(d)
    pos = a["watched"] == 1
    counts = np.bincount(a["rating"][pos].astype(np.int64), minlength=6)[1:]
    assert counts.tolist() == [6110, 11370, 27145, 34174, 21201]
    rated = set((a["user"][pos] * d.num_items + a["item"][pos]).tolist())
    assert not rated & set((a["user"][~pos] * d.num_items + a["item"][~pos]).tolist())


@pytest.mark.data
def test_real_ml1m_no_timestamps(real_data: Path) -> None:
    if not (real_data / "movielens/ml-1m/ratings_no_timestamps.csv.gz").is_file():
        pytest.skip("ratings_no_timestamps.csv.gz not present")
    d = load_movielens(real_data, "ml-1m", ratings_source="no-timestamps", download=False)
    assert (d.num_users, d.num_items, d.num_ratings) == (6040, 3706, 1_000_209)
    assert int((d.item_movie_ids == -1).sum()) == 20
    assert [len(getattr(d, s)) for s in SPLITS] == [1_600_334, 200_042, 200_042]
    train = d.train
    counts = np.bincount(train.rating[train.rating_mask].numpy().astype(np.int64), minlength=6)
    assert counts.sum() > 0.79 * 1_000_209


@pytest.mark.data
def test_real_ml1m_users_0001_2999(real_data: Path) -> None:
    path = real_data / "movielens/ml-1m/ratings_users_0001-2999.dat"
    if not path.is_file():
        pytest.skip("ratings_users_0001-2999.dat not present")
    r = read_ml1m_ratings(path)
    assert len(r) == 487_650 and int(r.user.max()) == 2999 and int(r.user.min()) == 1
    d = load_movielens(real_data, "ml-1m", ratings_source="users-0001-2999", download=False)
    assert d.num_users == 2999 and d.num_ratings == 487_650


@pytest.mark.data
def test_real_ml1m_raw_counts(real_data: Path) -> None:
    ml1m = real_data / "movielens/ml-1m"
    if not (ml1m / "ratings_no_timestamps.csv.gz").is_file():
        pytest.skip("ratings_no_timestamps.csv.gz not present")
    r = read_ml1m_ratings_no_timestamps(ml1m / "ratings_no_timestamps.csv.gz")
    assert np.bincount(r.rating, minlength=6)[1:].tolist() == [
        56174,
        107557,
        261197,
        348971,
        226310,
    ]
    assert int((r.movie == -1).sum()) == 35
    assert len(read_ml1m_users(ml1m / "users.dat").ids) == 6040
    assert len(read_ml1m_movies(ml1m / "movies.dat").ids) == 3883
    m = read_ml1m_item_index_map(ml1m / "item_index_to_movieid.csv")
    assert len(m.movie) == 3706 and int((m.movie == -1).sum()) == 20
