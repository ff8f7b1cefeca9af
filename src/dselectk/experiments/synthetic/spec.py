"""What the synthetic study is: its gates, the paper's grid and claims, and the defaults."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from dselectk.experiments.runner import grid_points as _product
from dselectk.io import json_safe

__all__ = [
    "ALL_GATES",
    "ANNEAL_END",
    "BASE_HPARAMS",
    "BATCH_SIZE",
    "DEFAULT_GATES",
    "EXPERIMENT",
    "GATES",
    "LABELS",
    "MEMBER_KEYS",
    "PAPER",
    "PAPER_GRID",
    "SEARCHES",
    "SEARCH_PROBE",
    "TUNED_AS",
    "K",
    "grid_points",
    "init_seed",
    "load_tuned",
    "record_config",
    "resolve_hparams",
]

EXPERIMENT = "synthetic"
K = 4
BATCH_SIZE = 256

#: experiment gate name → (registry name, fixed constructor kwargs)
GATES: dict[str, tuple[str, dict[str, Any]]] = {
    "dselect_k": ("dselect_k", {"init": "paper"}),
    "dselect_k_spread": ("dselect_k", {"init": "spread"}),
    "topk": ("topk", {}),
    "ablation_annealing": ("ablation_annealing", {}),
    "ablation_entropy": ("ablation_entropy", {}),
    # swap local search (dselectk.search; ours): the paper's gate, searched during training
    "dselect_k_search": ("dselect_k", {"init": "paper"}),
    "topk_search_refit": ("topk", {}),
}
#: search variants use the tuned hyperparameters of the gate they search
TUNED_AS = {
    "dselect_k_search": "dselect_k",
    "topk_search_refit": "topk",
}
#: swap local search of the search variants (dselectk.search.SwapSearch): after these fractions
#: of the training steps, scored by each (repetition, task)'s MSE on a fixed probe of the
#: training set; at ``binarize`` (DSelect-k) fractional selectors must take their best code
SEARCHES: dict[str, dict[str, Any]] = {
    # scored after refitting the selector shares (least squares on the K selector outputs)
    "dselect_k_search": {"at": (0.25, 0.7, 0.85), "binarize": 0.5, "refit": True},
    # Top-k + search scored as dselect_k_search is (least squares on the k selected experts)
    "topk_search_refit": {"at": (0.25, 0.5, 0.7, 0.85), "binarize": None, "refit": True},
}
SEARCH_PROBE = 2048
LABELS = {
    "dselect_k": "DSelect-k (paper init)",
    "dselect_k_spread": "DSelect-k (spread init, ours)",
    "topk": "Top-k",
    "ablation_annealing": "Ablation (Annealing)",
    "ablation_entropy": "Ablation (Entropy)",
    "dselect_k_search": "DSelect-k + swap local search (ours)",
    "topk_search_refit": "Top-k + swap local search, refit scoring (ours)",
}
#: the quick default: the paper's gates, our spread init, and DSelect-k + swap search (the
#: variant that is binary with exactly k experts and beats Top-k, docs/collapse.md §7)
DEFAULT_GATES = [
    "dselect_k",
    "dselect_k_spread",
    "dselect_k_search",
    "topk",
    "ablation_annealing",
    "ablation_entropy",
]
ALL_GATES = [
    *DEFAULT_GATES,
    "topk_search_refit",
]

#: the paper's tuning grid (Appendix D, "Synthetic Data")
PAPER_GRID: dict[str, list[float]] = {
    "lr": [1e-3, 1e-2, 1e-1],
    "epochs": [25, 50, 75, 100],
    "gamma": [5.0, 10.0, 15.0],
    "entropy_reg_dselect_k": [0.001, 0.005, 0.01, 0.1],
    "entropy_reg_ablation": [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 100.0],
    "temperature_start": [1e-6, 1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 5e-3, 1e-2],
}

#: the paper's claims for Appendix C.1 (text of the Results paragraph; Figure C.1 has no numbers
#: in the source we have)
PAPER = {
    "mse_improvement_128": 0.40,  # DSelect-k vs Top-k at 128 tasks: "over 40 % improvement"
    "related_jaccard_improvement_128": 0.76,  # "76 % improvement in Jaccard index (related)"
    "ablation_entropy_experts": 2.0,  # "ends up selecting ~2 experts in many repetitions"
}

#: hyperparameters used when neither the tuned file nor the command line gives one
BASE_HPARAMS: dict[str, Any] = {
    "lr": 0.01,
    "epochs": 25,
    "gamma": 10.0,
    "gamma_end": None,
    "entropy_reg": 0.0,
    "entropy_reg_end": None,
    "entropy_warmup": 0.0,
    "temperature_start": None,
    "diversity": None,
}


# --------------------------------------------------------------------------------------------

#: hyperparameters that may differ between the members of one batched model
MEMBER_KEYS = ("lr", "gamma", "entropy_reg", "temperature_start", "epochs")
#: the annealing gate's final temperature (Appendix D: from s down to 1e-16)
ANNEAL_END = 1e-16


def load_tuned(path: str | Path | None = None) -> dict[str, Any]:
    """The shipped tuning record ``tuned_synthetic.json``, or ``path``: a record of that form
    or a results folder's ``selected_hparams.json`` (``{"gate/T": {"hparams": ...}}``), so the
    final phase can be rerun with the selections of an earlier grid search."""
    if path is not None:
        try:
            rec = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--tuned {path}: cannot read a JSON tuning record ({e})") from e
        if not isinstance(rec, dict):
            raise ValueError(f"--tuned {path}: expected a JSON object")
        if "hparams" in rec:
            return rec
        per_gate: dict[str, dict[str, Any]] = {}
        for key, sel in rec.items():
            gate, _, t = str(key).partition("/")
            if not t.isdigit() or not isinstance(sel, dict) or "hparams" not in sel:
                raise ValueError(
                    f"--tuned {path}: expected a tuning record (with 'hparams') or a "
                    f"selected_hparams.json ('gate/T' keys), found key {key!r}"
                )
            per_gate.setdefault(gate, {})[t] = dict(sel["hparams"])
        return {"source": f"selections of {path}", "hparams": per_gate}
    text = resources.files("dselectk.experiments").joinpath("tuned_synthetic.json").read_text()
    return dict(json.loads(text))


def resolve_hparams(
    gate: str, num_tasks: int, tuned: Mapping[str, Any], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """BASE ← tuned[gate][str(T)] (or tuned[gate]["default"]) ← command-line overrides."""
    hp = dict(BASE_HPARAMS)
    table = tuned.get("hparams", {})
    per_gate = table.get(gate) or table.get(TUNED_AS.get(gate, gate), {})
    hp.update(per_gate.get(str(num_tasks), per_gate.get("default", {})))
    hp.update({k: v for k, v in overrides.items() if v is not None})
    return hp


def grid_points(gate: str, grid: Mapping[str, Sequence[float]]) -> list[dict[str, Any]]:
    """The paper's grid for one gate, without the epochs axis (see :func:`tune`)."""
    reg, _ = GATES[gate]
    axes: dict[str, Sequence[Any]] = {"lr": grid["lr"]}
    if reg == "dselect_k":
        axes["gamma"] = grid["gamma"]
        axes["entropy_reg"] = grid["entropy_reg_dselect_k"]
    elif reg == "ablation_entropy":
        axes["entropy_reg"] = grid["entropy_reg_ablation"]
    elif reg == "ablation_annealing":
        axes["temperature_start"] = grid["temperature_start"]
    return _product(axes)


def init_seed(seed: int, gate: str, num_tasks: int, rep: int) -> int:
    """Initialisation seed of one repetition (independent of how repetitions are batched)."""
    return (int(seed) * 1_000_003 + num_tasks * 10_007 + rep * 101 + sum(map(ord, gate))) % 2**31


def record_config(
    gate: str,
    num_tasks: int,
    hp: Mapping[str, Any],
    rep: int,
    init_seed: int,
    seed: int,
    data_cfg: Mapping[str, Any],
    phase: str,
) -> dict[str, Any]:
    return {
        "experiment": EXPERIMENT,
        "phase": phase,
        "gate": gate,
        "num_tasks": num_tasks,
        "hparams": dict(sorted(hp.items())),
        "rep": rep,
        "init_seed": init_seed,
        "shuffle_seed": seed,
        "batch_size": BATCH_SIZE,
        "data": dict(data_cfg),
        # the search schedule is part of a search variant's identity (other gates: unchanged)
        **({"search": json_safe(SEARCHES[gate])} if gate in SEARCHES else {}),
    }
