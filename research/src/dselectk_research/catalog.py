"""Every named gate variant the studies run, defined once: :data:`CATALOG`. A study takes its
rows by name (:func:`select`), under its own name where its records and flags have long used
another one, and with its own report label where its report words it differently; what a
variant *is* (gate, options, schedules, search plan, routing) is written only here.

Which study takes which rows:

- synthetic (Appendix C.1): ``dselect_k``, ``dselect_k_spread``, ``dselect_k_search``,
  ``topk``, ``topk_search`` (as ``topk_search_refit``), ``ablation_annealing``,
  ``ablation_entropy``;
- recovery (Appendix C.2.2): ``dselect_k``, ``dselect_k_search``, ``topk``, ``topk_search``,
  ``comet``;
- selection: recovery's rows, ``topk_budget``, ``comet_budget`` and ``search_only``;
- token-moe: ``dselect_k_token`` (as ``dselect_k``), ``topk``, ``dselect_k_distinct``,
  ``dselect_k_diversity``, ``expert_choice``;
- MovieLens and Multi-MNIST (Tables 1, 2, C.2, C.3): ``dselect_k_static``, ``topk_static``,
  ``gumbel_softmax``, ``dselect_k_per_example``, ``topk_per_example``, ``softmax``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from dselectk.gates.base import Gate
from dselectk.gates.registry import HParam, gate_spec
from dselectk.variants import Ramp, SearchPlan, Variant, variant_table
from dselectk_research.args import hparam_type, setting

__all__ = ["CATALOG", "FrozenSelectionVariant", "hparam_setting", "select"]

#: the swap search (dselectk.search; ours) of DSelect-k: after 25, 70 and 85 % of the steps,
#: fractional or colliding selectors forced onto their best free code after half; each move
#: scored after refitting the read-out of the selection
DSELECT_K_SEARCH = SearchPlan(at=(0.25, 0.7, 0.85), binarize=0.5, refit=True)
#: the swap search of Top-k (no binarization: its selection is discrete already)
TOPK_SEARCH = SearchPlan(at=(0.25, 0.5, 0.7, 0.85), refit=True)


@dataclass(frozen=True)
class FrozenSelectionVariant(Variant):
    """DSelect-k with its selection frozen: a gradient hook zeroes the gradient of the selector
    logits Z (the bits: which experts), so Adam never moves them (zero moments, zero step) and
    only the swap search changes the selection; the selector shares α (how much each selected
    expert weighs) and the rest of the model train at the arm's learning rate."""

    def build(self, num_experts: int, *, hparams: Any = None, **structure: Any) -> Gate:
        gate = super().build(num_experts, hparams=hparams, **structure)
        logits = getattr(gate, "logits", None)
        k = getattr(gate, "k", None)
        if not (gate.static and gate.searchable and isinstance(logits, torch.Tensor) and k):
            raise ValueError(f"{self.name}: needs a static DSelect-k gate, got {gate!r}")
        mask = torch.ones(logits.shape[-1], dtype=logits.dtype)
        mask[k:] = 0.0  # logits = [α (k), Z (k·m)] per gate
        logits.register_hook(lambda grad: grad * mask.to(grad))
        return gate

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "selection_frozen": True}


#: every named variant of the studies, by its catalog name
CATALOG: dict[str, Variant] = variant_table(
    # the paper's gates, and ours (research/notes/collapse.md)
    # (DSelectK always starts as the paper does; the spread init and the diversity penalty,
    # research options that measured no gain, are DSelectKExtended's: "dselect_k_extended")
    Variant("dselect_k", "dselect_k", "DSelect-k (paper init)"),
    Variant("dselect_k_spread", "dselect_k_extended", "DSelect-k (spread init, ours)",
            {"init": "spread"}),
    Variant("dselect_k_search", "dselect_k", "DSelect-k + swap local search (ours)",
            search=DSELECT_K_SEARCH, tuned_as="dselect_k"),
    Variant("topk", "topk", "Top-k"),
    Variant("topk_search", "topk", "Top-k + swap local search (ours)", search=TOPK_SEARCH,
            tuned_as="topk"),
    Variant("comet", "comet", "COMET tree gate (Ibrahim et al. 2023)"),
    # Appendix C.1's ablations; the temperature anneals from the tuned start s down to 1e-16
    Variant("ablation_annealing", "ablation_annealing", "Ablation (Annealing)",
            schedules=(Ramp("temperature", end=1e-16, shape="geometric"),)),
    Variant("ablation_entropy", "ablation_entropy", "Ablation (Entropy)"),
    # the selection study's no-search arms given the search's probe examples as extra epochs
    Variant("topk_budget", "topk", "Top-k, equal budget (probe examples as extra epochs)"),
    Variant("comet_budget", "comet", "COMET, equal budget (probe examples as extra epochs)"),
    FrozenSelectionVariant(
        "search_only", "dselect_k",
        "search only (DSelect-k's selection frozen at init, shares trained) + swap search",
        search=DSELECT_K_SEARCH, tuned_as="dselect_k",
    ),
    # per-token routers of a sparse MoE layer (DSelect-k at its default init, no options)
    Variant("dselect_k_token", "dselect_k", "DSelect-k (per token)"),
    Variant("dselect_k_distinct", "dselect_k", "DSelect-k, distinct codes (ours)",
            {"distinct": True}),
    Variant("dselect_k_diversity", "dselect_k_extended", "DSelect-k, diversity μ = 0.1 (ours)",
            {"diversity": 0.1}),
    Variant("expert_choice", "softmax",
            "Expert choice (Zhou et al. 2022; softmax router, capacity k·N/n)", routing="expert"),
    # the gates of the real-data tables (static, or per-example: the gate sees the example)
    Variant("dselect_k_static", "dselect_k", "Static DSelect-k"),
    Variant("topk_static", "topk", "Static Top-k"),
    Variant("gumbel_softmax", "gumbel_softmax", "Static Gumbel Softmax"),
    Variant("dselect_k_per_example", "dselect_k", "Per-example DSelect-k"),
    Variant("topk_per_example", "topk", "Per-example Top-k"),
    Variant("softmax", "softmax", "Softmax MoE"),
)  # fmt: skip


def select(
    *names: str,
    renamed: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Variant]:
    """A study's table: the :data:`CATALOG` rows ``names`` (the study's names, in its order).
    ``renamed``: study name → catalog name, for a row a study knows by another name (its
    records and flags carry it); ``labels``: study name → the label its report uses.

    Raises:
        ValueError: a name (or a renamed or labelled one) the catalog or the selection lacks.
    """
    renamed, labels = dict(renamed or {}), dict(labels or {})
    for what, keys in (("renamed", renamed), ("labels", labels)):
        stray = sorted(set(keys) - set(names))
        if stray:
            raise ValueError(f"select: {what} names {stray} not among the selected {names}")
    rows = []
    for name in names:
        source = renamed.get(name, name)
        if source not in CATALOG:
            raise ValueError(f"select: no variant {source!r} in the catalog ({list(CATALOG)})")
        v = CATALOG[source]
        if name != source or name in labels:
            v = replace(v, name=name, label=labels.get(name, v.label))
        rows.append(v)
    return variant_table(*rows)


def declaration(param: str) -> HParam:
    """The gate registry's declaration of the hyperparameter ``param`` (type, range, doc), as
    the gates of the catalog's variants declare it.

    Raises:
        ValueError: no gate of the catalog declares ``param``, or two declare it differently.
    """
    found = {
        gate_spec(g).hparams[param]
        for g in sorted({v.gate for v in CATALOG.values()})
        if param in gate_spec(g).hparams
    }
    if len(found) != 1:
        why = "no gate of the catalog declares it" if not found else f"declared as {found}"
        raise ValueError(f"hyperparameter {param!r}: {why}")
    return found.pop()


def hparam_setting(param: str, default: Any, help: str, alias: str | None = None) -> Any:
    """A run-config :func:`~dselectk_research.args.setting` whose value is one of the gate
    hyperparameter ``param`` (an override, or the end value of a ramp of it): its argparse
    type and the range its help states come from the registry's declaration
    (:func:`declaration`), never written by hand."""
    h = declaration(param)
    return setting(default, f"{help} ({h.range_text()})", alias, type=hparam_type(h))
