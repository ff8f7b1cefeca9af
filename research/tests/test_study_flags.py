"""The studies' hyperparameter flags come from the gate registry's declarations."""

from __future__ import annotations

import pytest


def test_hyperparameter_flags_come_from_the_declarations(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    from dselectk_research.args import add_hparam_arguments

    p = argparse.ArgumentParser()
    names = add_hparam_arguments(p, ["dselect_k", "dselect_k_extended", "ablation_annealing"])
    assert names == [
        "distinct",
        "diversity",
        "entropy_reg",
        "gamma",
        "init",
        "init_std",
        "temperature",
        "xi",
    ]
    args = p.parse_args(["--gamma", "5", "--init", "spread", "--temperature", "1e-3"])
    assert (args.gamma, args.init, args.temperature, args.xi) == (5.0, "spread", 1e-3, None)
    for bad, msg in [
        (["--gamma", "0"], "argument --gamma: expected a number > 0, got 0.0"),
        (["--gamma", "nan"], "argument --gamma: expected a finite number, got 'nan'"),
        (["--init", "distinct"], "argument --init: expected one of 'paper', 'spread'"),
        (["--entropy-reg", "-1"], "argument --entropy-reg: expected a number >= 0, got -1.0"),
    ]:
        with pytest.raises(SystemExit) as e:
            p.parse_args(bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err
