"""The studies' search variants select k distinct experts."""

from __future__ import annotations


def test_recovery_search_variant_ends_binary_with_k_distinct_experts() -> None:
    from dselectk_research.data.recovery import RecoveryData
    from dselectk_research.recovery.model import VARIANTS, train_reps

    assert {n for n, v in VARIANTS.items() if v.search} >= {"dselect_k_search", "topk_search"}
    data = RecoveryData(0, n_train=1024, n_val=256)
    hp = {"gamma": 10.0, "entropy_reg": 0.1, "epochs": 4, "lr": 0.1}
    metrics, _ = train_reps(VARIANTS["dselect_k_search"], hp, data, [1, 2], shuffle_seed=0)
    for m in metrics:
        assert m["binary"] == 1.0 and m["experts_selected"] == 4.0
    hp = {"epochs": 4, "lr": 0.1}
    topk, _ = train_reps(VARIANTS["topk_search"], hp, data, [1], shuffle_seed=0)
    assert topk[0]["experts_selected"] == 4.0


def test_synthetic_search_variant_ends_binary_with_k_experts_per_task() -> None:
    from dselectk_research.data.synthetic import generate_data
    from dselectk_research.synthetic.spec import VARIANTS, load_tuned, resolve_hparams
    from dselectk_research.synthetic.train import train_reps

    tuned_as = {n for n, v in VARIANTS.items() if v.tuned_as is not None}
    assert tuned_as == {n for n, v in VARIANTS.items() if v.search is not None}
    tuned = load_tuned()
    hp = resolve_hparams("dselect_k_search", 32, tuned, {"epochs": 3})
    assert hp == resolve_hparams("dselect_k", 32, tuned, {"epochs": 3})  # the paper gate's
    data = generate_data(0, 2048, 256, 256)
    res = train_reps("dselect_k_search", 32, hp, [1, 2], data, shuffle_seed=0)
    for m in res[3]:
        assert m["frac_tasks_binary"] == 1.0 and m["frac_tasks_k_experts"] == 1.0


def test_the_search_schedule_is_part_of_a_search_variants_identity() -> None:
    from dselectk_research.recovery.recipe import VARIANTS, RecoveryConfig, _record_config
    from dselectk_research.synthetic.spec import record_config

    cfg = record_config("dselect_k_search", 32, {"lr": 0.01}, 0, 1, 0, {}, "final")
    assert cfg["variant"]["search"] == {"at": [0.25, 0.7, 0.85], "binarize": 0.5, "refit": True}
    plain = record_config("dselect_k", 32, {"lr": 0.01}, 0, 1, 0, {}, "final")
    assert "search" not in plain["variant"]
    from pathlib import Path

    run = RecoveryConfig(Path("out"))
    rec = _record_config(run, VARIANTS["dselect_k_search"], {"lr": 0.1}, 0, 1)
    assert (
        rec["variant"]["search"]["binarize"] == 0.5
        and "search" not in _record_config(run, VARIANTS["topk"], {"lr": 0.1}, 0, 1)["variant"]
    )
