"""The MovieLens embedding bottom (:mod:`dselectk.layers.embedding`)."""

from __future__ import annotations

import torch

from dselectk.layers.embedding import EMBED_DIMS, MovieLensEmbedding


def test_embedding_bottom_concatenates_ids_and_side_features() -> None:
    ids_only = MovieLensEmbedding(5, 7)
    assert ids_only.out_features == EMBED_DIMS["user"] + EMBED_DIMS["item"] == 64
    x = torch.tensor([[0, 6], [4, 1]])
    assert ids_only(x).shape == (2, 64)
    side = MovieLensEmbedding(5, 7, side=(7, 2, 21, 3))
    assert side.out_features == 64 + 4 + 2 + 4 + 8
    x = torch.tensor([[0, 6, 1, 0, 20, 1, 0, 1], [4, 1, 6, 1, 0, 0, 0, 0]])
    out = side(x)
    assert out.shape == (2, 82)
    # the genres enter linearly: no genre gives the linear layer's bias
    torch.testing.assert_close(out[1, -8:], side.genres.bias)
