"""Layout of the real-data experiments: the shared package never imports its recipes, the
recipes' specs travel to sweep workers, the grid search draws the points it always drew."""

from __future__ import annotations

import itertools
import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dselectk_research import movielens as ml
from dselectk_research import multi_mnist as mm
from dselectk_research import realdata as rd
from dselectk_research.realdata.recipe import build_recipe
from dselectk_research.runner import grid_points, sample_points


def test_realdata_does_not_import_the_recipes() -> None:
    code = (
        "import sys, dselectk_research.realdata\n"
        "print(sorted(m for m in sys.modules if m.startswith('dselectk_research.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = out.stdout
    assert "dselectk_research.realdata.recipe" in loaded
    assert "movielens" not in loaded and "multi_mnist" not in loaded


def test_experiment_specs_pickle_for_the_sweep_workers() -> None:
    for exp in (ml.experiment(), mm.experiment("multi-fashion")):
        back = pickle.loads(pickle.dumps(exp))
        assert back.name == exp.name and back.build_model is exp.build_model


def test_tune_points_are_the_former_sorted_grid_and_sample() -> None:
    exp = ml.experiment()
    for gate, setting, points in (("dselect_k_static", 0.5, 20), ("softmax", 0.1, 1000)):
        grid = {**exp.grid[gate], "epochs": [1]}
        keys = sorted(grid)
        former = [dict(zip(keys, v)) for v in itertools.product(*(grid[k] for k in keys))]
        rng = random.Random(f"{exp.name}|{gate}|{json.dumps(setting)}|0")
        if points < len(former):
            former = rng.sample(former, points)
        seed = f"{exp.name}|{gate}|{json.dumps(setting)}|0"
        assert sample_points(grid_points(grid, sort_keys=True), points, seed) == former


def test_notes_template_keeps_quick_paragraphs_for_quick_mode() -> None:
    values = {"title": "Multi-MNIST", "n_train": "6,000", "n_val": "1,000", "n_test": "2,000"}
    values["init_note"] = "Keras initialisation, TF constants."  # the defaults paragraph
    full = rd.template_notes("multi_mnist", quick=False, epochs=3, repetitions=1, **values)
    quick = rd.template_notes("multi_mnist", quick=True, epochs=3, repetitions=1, **values)
    assert len(full) == 4 and quick[:4] == full and len(quick) == 5
    assert full[2].startswith("Initialisation and optimizer constants: Keras initialisation")
    assert full[0].startswith("Data: Multi-MNIST built by `load_multi_mnist`")
    assert "6,000 / 1,000 / 2,000 train / val / test images" in full[0]
    assert quick[4].startswith("Quick mode:") and "3 epochs instead of 25–100" in quick[4]
    assert not any("<!--" in n for n in quick)


def test_recipe_pickles_and_hparams_are_checked_against_the_gates(tmp_path: Path) -> None:
    config = mm.MultiMNISTConfig(out=tmp_path, gates=("dselect_k_static", "shared_bottom"))
    recipe = pickle.loads(pickle.dumps(build_recipe(mm.experiment("multi-mnist"), config)))
    assert recipe.cells == [(None, "dselect_k_static"), (None, "shared_bottom")]
    ml_config = ml.MovieLensConfig(out=tmp_path, gates=("softmax",), alphas=(0.1, 0.9))
    assert build_recipe(ml.experiment(), ml_config).cells == [(0.1, "softmax"), (0.9, "softmax")]
    for exp in (ml.experiment(), mm.experiment("multi-mnist")):
        for gate, hp in exp.quick_hparams.items():
            rd.VARIANTS[gate].check_hparams(hp)
            for point in grid_points(exp.grid[gate]):
                rd.VARIANTS[gate].check_hparams({**hp, **point})
    with pytest.raises(ValueError, match="no hyperparameter 'gamma'"):
        rd.VARIANTS["topk_static"].check_hparams({"lr": 0.1, "k": 2, "gamma": 1.0})
    with pytest.raises(ValueError, match="gamma"):
        rd.VARIANTS["dselect_k_static"].check_hparams({"k": 2, "gamma": -1.0})
    with pytest.raises(ValueError, match="shared bottom takes no"):
        rd.VARIANTS["shared_bottom"].check_hparams({"units": 8, "gamma": 1.0})
