"""An embedding bottom for recommendation inputs: id columns (and side features) → floats.

:class:`MovieLensEmbedding` is the input layer of the MovieLens models of Section 4.1 (the paper
does not describe its input layer): it embeds the user and movie ids (and the user's age
bucket, gender and occupation, and the movie's multi-hot genres) and concatenates the
embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from dselectk._validate import check_sizes
from dselectk.gates.base import check_positive_int

__all__ = ["EMBED_DIMS", "MovieLensEmbedding"]

#: embedding sizes of the columns
EMBED_DIMS = {"user": 32, "item": 32, "age": 4, "gender": 2, "occupation": 4, "genres": 8}


class MovieLensEmbedding(nn.Module):
    """Embedding bottom: int64 columns (user, item[, age, gender, occupation, genres...]) → floats.

    The paper does not describe its input layer; we embed the ids (and side features) and
    concatenate the embeddings (dimensions in :data:`EMBED_DIMS`).

    Args:
        num_users, num_items: vocabulary sizes of the ids.
        side: (num_age_buckets, num_genders, num_occupations, num_genres), or None for ids only.
        dims: embedding sizes.

    Examples:
        >>> from dselectk.layers.embedding import MovieLensEmbedding
        >>> bottom = MovieLensEmbedding(num_users=100, num_items=50)  # ids only
        >>> ids = torch.stack([torch.randint(0, 100, (4,)), torch.randint(0, 50, (4,))], dim=1)
        >>> tuple(bottom(ids).shape), bottom.out_features  # user (32) + item (32) embeddings
        ((4, 64), 64)
    """

    def __init__(
        self,
        num_users: int,
        num_items: int,
        side: Sequence[int] | None = None,
        dims: Mapping[str, int] = EMBED_DIMS,
    ) -> None:
        super().__init__()
        check_positive_int("num_users", num_users)
        check_positive_int("num_items", num_items)
        if side is not None:
            side = check_sizes("side", side)
            if len(side) != 4:
                raise ValueError(
                    f"side must be (num_age_buckets, num_genders, num_occupations, num_genres), "
                    f"4 sizes, got {len(side)}"
                )
        if not isinstance(dims, Mapping):
            raise TypeError(f"dims must be a mapping of embedding sizes, got {type(dims).__name__}")
        needed = ["user", "item"] + (["age", "gender", "occupation", "genres"] if side else [])
        absent = [k for k in needed if k not in dims]
        if absent:
            raise ValueError(f"dims must give the embedding size of {absent} (see EMBED_DIMS)")
        check_sizes("dims", [dims[k] for k in needed])
        self.user = nn.Embedding(num_users, dims["user"])
        self.item = nn.Embedding(num_items, dims["item"])
        self.out_features = dims["user"] + dims["item"]
        self.has_side = side is not None
        if side is not None:
            ages, genders, occs, genres = side
            self.age = nn.Embedding(ages, dims["age"])
            self.gender = nn.Embedding(genders, dims["gender"])
            self.occupation = nn.Embedding(occs, dims["occupation"])
            self.genres = nn.Linear(genres, dims["genres"])
            self.num_genres = genres
            self.out_features += dims["age"] + dims["gender"] + dims["occupation"] + dims["genres"]

    def forward(self, x: Tensor) -> Tensor:
        parts = [self.user(x[:, 0]), self.item(x[:, 1])]
        if self.has_side:
            parts += [
                self.age(x[:, 2]),
                self.gender(x[:, 3]),
                self.occupation(x[:, 4]),
                self.genres(x[:, 5:].to(self.genres.weight.dtype)),
            ]
        return torch.cat(parts, dim=-1)
