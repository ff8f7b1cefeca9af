"""``setting`` / ``add_config_arguments``: a run config's fields declare their own flags once
(name, type, default, help, nargs, choices), and ``config_from_args`` builds the config back."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from dselectk_research.args import (
    add_config_arguments,
    config_from_args,
    int_at_least,
    positive_float,
    setting,
)


@dataclasses.dataclass(frozen=True)
class _Config:
    out: Path
    n_train: int = setting(100, "training rows", type=int_at_least(1))
    gates: tuple[str, ...] = setting(("a", "b"), "gates", choices=["a", "b", "c"])
    lr: float | None = setting(None, "override the learning rate", type=positive_float)
    full: bool = setting(False, "paper protocol")
    temperature: float = setting(1.0, "start temperature", "--temperature-start", type=float)
    sizes: tuple[int, ...] = setting((1, 2), "resolved when absent", type=int, default=None)
    telemetry: bool = False  # no flag: another layer's


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="study")
    p.add_argument("--out", type=Path, default=Path("res"))
    add_config_arguments(p, _Config)
    return p


def test_one_flag_per_setting_in_field_order() -> None:
    actions = {a.dest: a for a in _parser()._actions}
    flags = [a.option_strings for a in _parser()._actions if a.dest not in ("help", "out")]
    assert flags == [
        ["--n-train"],
        ["--gates"],
        ["--lr"],
        ["--full"],
        ["--temperature", "--temperature-start"],
        ["--sizes"],
    ]
    assert "telemetry" not in actions
    assert actions["n_train"].help == "training rows" and actions["n_train"].default == 100
    assert actions["gates"].nargs == "+" and actions["gates"].choices == ["a", "b", "c"]
    assert actions["gates"].default == ("a", "b")
    assert actions["lr"].type is positive_float and actions["lr"].default is None
    assert isinstance(actions["full"], argparse._StoreTrueAction)
    assert actions["sizes"].default is None  # the flag's own default, not the field's
    assert _Config(out=Path("x")).sizes == (1, 2)


def test_config_from_the_parsed_flags() -> None:
    p = _parser()
    config = config_from_args(_Config, p.parse_args([]))
    assert config == _Config(out=Path("res"), sizes=None)
    argv = ["--n-train", "7", "--gates", "c", "a", "c", "--full", "--temperature-start", "0.5"]
    config = config_from_args(_Config, p.parse_args(argv), sizes=(3,))
    assert (config.n_train, config.gates, config.full) == (7, ("c", "a"), True)
    assert (config.temperature, config.sizes, config.lr) == (0.5, (3,), None)
    hash(config)  # lists became tuples


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--n-train", "0"], "argument --n-train: expected an integer >= 1, got 0"),
        (["--lr", "nan"], "argument --lr: expected a finite number, got 'nan'"),
        (["--gates", "d"], "argument --gates: invalid choice: 'd'"),
        (["--full", "yes"], "unrecognized arguments: yes"),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_setting_may_take_its_own_nargs_or_action() -> None:
    @dataclasses.dataclass(frozen=True)
    class Own:
        tasks: tuple[int, ...] = setting((1,), "T", type=int, nargs="*", default=None)
        renormalize: bool = setting(False, "a value", type=str, action="store")

    p = argparse.ArgumentParser()
    add_config_arguments(p, Own)
    assert p.parse_args(["--tasks"]).tasks == []
    assert p.parse_args(["--renormalize", "true"]).renormalize == "true"


def test_help_lists_the_settings() -> None:
    text = _parser().format_help()
    assert "--n-train N_TRAIN     training rows" in text
    assert "--temperature TEMPERATURE, --temperature-start TEMPERATURE" in text
    assert "--gates {a,b,c} [{a,b,c} ...]" in text


def test_the_recipes_flags_match_their_configs() -> None:
    """Every flag a recipe declares through its config defaults to the config's default, or to
    None where the recipe resolves an absent flag (quick or full values)."""
    from dselectk_research import movielens, multi_mnist
    from dselectk_research.recovery import recipe as recovery
    from dselectk_research.selection import recipe as selection
    from dselectk_research.synthetic import recipe as synthetic
    from dselectk_research.token_moe import recipe as token_moe

    for add, cls, resolved in [
        (synthetic.add_arguments, synthetic.SyntheticConfig, set()),
        (token_moe.add_arguments, token_moe.TokenMoEConfig, set()),
        (recovery.add_arguments, recovery.RecoveryConfig, set()),
        (
            selection.add_arguments,
            selection.SelectionConfig,
            {"shapes", "reps", "lrs", "tasks"},
        ),
        (movielens.add_arguments, movielens.MovieLensConfig, {"gates", "alphas"}),
        (
            multi_mnist.add_arguments,
            multi_mnist.MultiMNISTConfig,
            {"gates", "n_train", "n_val", "n_test"},
        ),
    ]:
        p = argparse.ArgumentParser()
        add(p)
        args = vars(p.parse_args([]))
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                want = None if f.name in resolved else f.default
                assert args[f.name] == want, (cls.__name__, f.name)
