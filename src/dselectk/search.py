"""Swap local search for sparse static gates (:class:`SwapSearch`, :func:`swap_search`,
:class:`SearchPlan`): the public home of :mod:`dselectk.training.search`, where it lives beside
the loop that runs it by default (``TrainConfig.search``)."""

from dselectk.training.search import (
    BINARIZING_PLAN,
    SWAP_PLAN,
    RefitStats,
    SearchPlan,
    SearchResult,
    SwapSearch,
    default_plan,
    logistic_refit_bce,
    model_searches,
    selector_refit_mse,
    swap_search,
)

__all__ = [
    "BINARIZING_PLAN",
    "SWAP_PLAN",
    "RefitStats",
    "SearchPlan",
    "SearchResult",
    "SwapSearch",
    "default_plan",
    "logistic_refit_bce",
    "model_searches",
    "selector_refit_mse",
    "swap_search",
]
