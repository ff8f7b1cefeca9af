"""The variant catalog (one definition per named variant, each study's rows taken from it), the
shared best-configuration rule, and hyperparameter flags typed by the gate registry."""

from __future__ import annotations

import argparse
import math

import pytest

from dselectk.gates.registry import gate_spec
from dselectk_research.best import best_configuration
from dselectk_research.catalog import CATALOG, declaration, hparam_setting, select


def test_every_study_table_is_made_of_catalog_rows() -> None:
    from dselectk_research.realdata.spec import VARIANTS as RD
    from dselectk_research.recovery import VARIANTS as REC
    from dselectk_research.selection.study import ARMS, C1_ARMS
    from dselectk_research.synthetic import VARIANTS as SYN
    from dselectk_research.token_moe.model import ROUTERS

    renamed = {
        ("synthetic", "topk_search_refit"): "topk_search",
        ("tok", "dselect_k"): "dselect_k_token",
    }
    for study, table in (("synthetic", SYN), ("recovery", REC), ("selection", ARMS),
                         ("c1", C1_ARMS), ("tok", ROUTERS)):  # fmt: skip
        for name, v in table.items():
            row = CATALOG[renamed.get((study, name), name)]
            assert v.name == name
            assert (v.gate, v.options, v.schedules, v.routing, v.tuned_as) == (
                row.gate, row.options, row.schedules, row.routing, row.tuned_as)  # fmt: skip
            assert v.identity() == row.identity()  # the records' identity of the variant
    for name, c in RD.items():
        assert c.variant is None if name == "shared_bottom" else c.variant is CATALOG[name]
    # the selection study's search arms count their probe passes; the plan is the catalog's
    assert (
        ARMS["dselect_k_search"].search.identity() == CATALOG["dselect_k_search"].search.identity()
    )
    assert type(ARMS["search_only"]) is type(CATALOG["search_only"])


def test_select_renames_relabels_and_refuses_unknown_names() -> None:
    t = select("a_topk", "dselect_k", renamed={"a_topk": "topk"}, labels={"dselect_k": "X"})
    assert list(t) == ["a_topk", "dselect_k"]
    assert t["a_topk"].name == "a_topk" and t["a_topk"].identity() == CATALOG["topk"].identity()
    assert t["dselect_k"].label == "X" and CATALOG["dselect_k"].label != "X"
    assert select("topk")["topk"] is CATALOG["topk"]
    with pytest.raises(ValueError, match="no variant 'nope'"):
        select("nope")
    with pytest.raises(ValueError, match="labels names"):
        select("topk", labels={"comet": "Y"})


def test_rule_lowest_mean_ties_to_the_earliest_and_diverged_ineligible() -> None:
    c = best_configuration([("a", [1.0, 3.0]), ("b", [2.0, 2.0]), ("c", [0.5, math.nan])])
    assert c.key == "a" and c.mean == 2.0 and c.diverged == ("c",)  # a, b tie: a came first
    assert c.means[:2] == (2.0, 2.0) and math.isnan(c.means[2])
    c = best_configuration([("b", [2.0, 2.0]), ("a", [1.0, 3.0])])
    assert c.key == "b"
    assert best_configuration([("x", [None]), ("y", [float("inf")])]).key is None
    assert best_configuration([("lo", [0.7]), ("hi", [0.9])], maximize=True).key == "hi"
    # the study's eligibility and preference
    c = best_configuration([("a", [1.0]), ("b", [2.0])], eligible=lambda k: k != "a")
    assert c.key == "b"
    c = best_configuration([("a", [1.0]), ("b", [2.0]), ("c", [3.0])], prefer=lambda k: k != "a")
    assert c.key == "b" and c.preferred and c.preferred_count == 2
    c = best_configuration([("a", [1.0]), ("b", [2.0])], prefer=lambda k: False)
    assert c.key == "a" and not c.preferred  # nothing preferred: the best of the rest
    with pytest.raises(ValueError, match="no values"):
        best_configuration([("a", [])])
    with pytest.raises(ValueError, match="given twice"):
        best_configuration([("a", [1.0]), ("a", [2.0])])


def test_hparam_flags_take_type_and_range_from_the_registry() -> None:
    assert declaration("gamma") is gate_spec("dselect_k").hparams["gamma"]
    with pytest.raises(ValueError, match="'nope'"):
        declaration("nope")
    field = hparam_setting("entropy_reg", None, "λ")
    _, kw = field.metadata["flag"]
    assert kw["help"] == f"λ ({gate_spec('dselect_k').hparams['entropy_reg'].range_text()})"
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--x", **{k: v for k, v in kw.items() if k != "help"})
    assert p.parse_args(["--x", "0"]).x == 0.0
    with pytest.raises(argparse.ArgumentError, match="expected a number >= 0"):
        p.parse_args(["--x", "-1"])
    from dselectk_research.realdata.spec import RealDataConfig
    from dselectk_research.synthetic.recipe import SyntheticConfig

    fields = __import__("dataclasses").fields
    flags = {f.name: f.metadata["flag"][1] for f in fields(SyntheticConfig) if "flag" in f.metadata}
    for name in ("gamma", "gamma_end", "entropy_reg", "entropy_reg_end", "temperature"):
        assert "(a number" in flags[name]["help"]
    rd = {f.name: f for f in fields(RealDataConfig)}
    assert "(a number > 0)" in rd["gamma"].metadata["flag"][1]["help"]
