"""What the synthetic study is: its variants, the paper's grid and claims, and the defaults."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from dselectk.variants import Ramp, Variant
from dselectk_research.args import check_task_key, check_tuned_entry, read_json_object
from dselectk_research.catalog import select
from dselectk_research.seeds import derive_seed

EXPERIMENT = "synthetic"
K = 4
BATCH_SIZE = 256

#: the study's gate variants (``--gates``; :mod:`dselectk_research.catalog`); the search variants
#: (ours) run the swap local search during training, scored by each (repetition, task)'s MSE on
#: a probe of the training set after refitting the selector shares (least squares), and use the
#: tuned values of the gate they search
VARIANTS: dict[str, Variant] = select(
    "dselect_k", "dselect_k_spread", "dselect_k_search", "topk", "topk_search_refit",
    "ablation_annealing", "ablation_entropy",
    renamed={"topk_search_refit": "topk_search"},
    labels={"topk_search_refit": "Top-k + swap local search, refit scoring (ours)"},
)  # fmt: skip
#: the quick default, every variant but topk_search_refit: the paper's gates, our spread init,
#: and DSelect-k + swap search (binary with exactly k experts, beats Top-k,
# research/notes/collapse.md §7)
DEFAULT_GATES = [g for g in VARIANTS if g != "topk_search_refit"]

#: the paper's tuning grid (Appendix D, "Synthetic Data"): the trainer's axes, then the values of
#: each gate's hyperparameters (the hyperparameters a study run of that gate takes)
TRAINER_GRID: dict[str, list[float]] = {"lr": [1e-3, 1e-2, 1e-1], "epochs": [25, 50, 75, 100]}
_DSELECT_K_AXES = {"gamma": [5.0, 10.0, 15.0], "entropy_reg": [0.001, 0.005, 0.01, 0.1]}
GATE_GRID: dict[str, dict[str, list[float]]] = {
    "dselect_k": _DSELECT_K_AXES,
    # DSelectKExtended (the spread-init variant, ours): DSelect-k's axes
    "dselect_k_extended": _DSELECT_K_AXES,
    "topk": {},
    # not in the paper (COMET came later); its γ and λ mean what DSelect-k's do: the same axes
    "comet": {"gamma": [5.0, 10.0, 15.0], "entropy_reg": [0.001, 0.005, 0.01, 0.1]},
    "ablation_entropy": {"entropy_reg": [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 100.0]},
    "ablation_annealing": {
        "temperature": [1e-6, 1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 5e-3, 1e-2]
    },
}

#: the paper's claims for Appendix C.1 (text of the Results paragraph)
PAPER = {
    "mse_improvement_128": 0.40,  # DSelect-k vs Top-k at 128 tasks: "over 40 % improvement"
    "related_jaccard_improvement_128": 0.76,  # "76 % improvement in Jaccard index (related)"
    "ablation_entropy_experts": 2.0,  # "ends up selecting ~2 experts in many repetitions"
}

#: values used when neither the tuned file nor the command line gives one (of the keys a
#: variant takes, :func:`paper_grid`)
BASE_HPARAMS: dict[str, Any] = {
    "lr": 0.01,
    "epochs": 25,
    "gamma": 10.0,
    "entropy_reg": 0.0,
    "temperature": 1.0,
}


def variant_of(gate: str | Variant) -> Variant:
    """The variant named ``gate`` (a :class:`Variant` is returned as it is)."""
    if isinstance(gate, Variant):
        return gate
    if gate not in VARIANTS:
        raise ValueError(f"unknown gate {gate!r}; expected one of {sorted(VARIANTS)}")
    return VARIANTS[gate]


def paper_grid(variant: Variant) -> dict[str, list[float]]:
    """The paper's grid of one variant: lr, epochs and its gate's axes (in that order)."""
    return {**TRAINER_GRID, **GATE_GRID[variant.gate]}


def with_ramps(variant: Variant, ramps: Sequence[Ramp]) -> Variant:
    """``variant`` with the command line's ramps of the hyperparameters it takes."""
    return variant.with_ramps(ramps, paper_grid(variant))


def load_tuned(path: str | Path | None = None) -> dict[str, Any]:
    """The shipped tuning record ``tuned_synthetic.json``, or ``path``: a record of that form
    or a results folder's ``selected_hparams.json`` (``{"gate/T": {"hparams": ...}}``), so the
    final phase can be rerun with the selections of an earlier grid search. Every entry is
    checked against its variant's declared hyperparameters (ValueError naming the file)."""
    if path is None:
        where, digest = "tuned_synthetic.json", None
        rec = dict(json.loads(resources.files("dselectk_research").joinpath(where).read_text()))
    else:
        rec, digest = read_json_object(path, "--tuned")
        where = f"--tuned {path}"
    if "hparams" not in rec:
        per_gate: dict[str, dict[str, Any]] = {}
        for key, sel in rec.items():
            gate, _, t = str(key).partition("/")
            if not (t.isdigit() and isinstance(sel, dict) and isinstance(sel.get("hparams"), dict)):
                raise ValueError(
                    f"{where}: expected a tuning record (with 'hparams') or a "
                    f"selected_hparams.json ('gate/T' keys), found key {key!r}"
                )
            check_task_key(f"{where}: {key}", t)
            per_gate.setdefault(gate, {})[t] = dict(sel["hparams"])
        rec = {"source": f"selections of {path}", "hparams": per_gate}
    table = rec["hparams"]
    if not isinstance(table, dict) or not all(
        isinstance(per_t, dict) and all(isinstance(hp, dict) for hp in per_t.values())
        for per_t in table.values()
    ):
        raise ValueError(
            f"{where}: 'hparams' must map gate -> T (or \"default\") -> {{hyperparameter: value}}"
        )
    for gate, per_t in table.items():
        if gate not in VARIANTS:  # an unknown gate name first
            raise ValueError(f"{where}: unknown gate {gate!r}; expected one of {sorted(VARIANTS)}")
        if path is not None and not per_t:
            raise ValueError(f'{where}: {gate} has no entries (give a "default" or one per T)')
        for t, hp in per_t.items():
            if path is not None:  # a user's file: every key is used, every entry says something
                check_task_key(f"{where}: {gate}", t)
                check_tuned_entry(f"{where}: {gate}/{t}", hp)
            variant_of(gate).check_hparams(hp, f"{where}: {gate}/{t}")
    if digest is None:
        return rec
    # the report credits the file by its content, not only its name
    source = f"{rec.get('source', 'tuning record')} (--tuned {path}, sha256 {digest})"
    return {**rec, "source": source, "sha256": digest}


def tuned_entry(tuned: Mapping[str, Any], v: Variant, num_tasks: int) -> dict[str, Any] | None:
    """The tuning record's hyperparameters of ``v`` at T = ``num_tasks`` (its entry for T, else
    its ``"default"``; under the variant's name or the name it is tuned as), or None."""
    table = tuned.get("hparams", {})
    per_gate = table.get(v.name) or table.get(v.tuned_name) or {}
    return per_gate.get(str(num_tasks), per_gate.get("default"))


def resolve_hparams(
    gate: str | Variant, num_tasks: int, tuned: Mapping[str, Any], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """BASE ← the tuning record's entry (:func:`tuned_entry`) ← command-line overrides, the
    base values and overrides restricted to the hyperparameters the variant takes."""
    v = variant_of(gate)
    keys = paper_grid(v)
    hp = {k: BASE_HPARAMS[k] for k in keys}
    hp.update(tuned_entry(tuned, v, num_tasks) or {})
    hp.update({k: x for k, x in overrides.items() if x is not None and k in keys})
    return v.check_hparams(hp, f"hyperparameters of {v.name}")


def init_seed(seed: int, gate: str, num_tasks: int, rep: int) -> int:
    """Initialisation seed of one repetition (independent of how repetitions are batched):
    :func:`~dselectk_research.seeds.derive_seed` over T, the repetition and the gate."""
    return derive_seed(seed, (10_007, num_tasks), (101, rep), (1, gate))


def record_config(
    variant: str | Variant,
    num_tasks: int,
    hp: Mapping[str, Any],
    rep: int,
    init_seed: int,
    seed: int,
    data_cfg: Mapping[str, Any],
    phase: str,
    shape: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The identity of one run. ``shape``: ``num_experts`` and ``k`` (default T/4 and 4)."""
    v = variant_of(variant)
    return {
        "experiment": EXPERIMENT,
        "phase": phase,
        "gate": v.name,
        "num_tasks": num_tasks,
        **(shape or {"num_experts": num_tasks // 4, "k": K}),
        "hparams": dict(sorted(hp.items())),
        "rep": rep,
        "init_seed": init_seed,
        "shuffle_seed": seed,
        "batch_size": BATCH_SIZE,
        "data": dict(data_cfg),
        "variant": v.identity(),  # options, schedules and search plan
    }
