"""Plots are written atomically."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_a_plot_that_fails_to_render_keeps_the_earlier_png(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from dselectk_research.plots._mpl import plt
    from dselectk_research.plots.core import plot_trajectories, save_png

    path = tmp_path / "traj.png"
    plot_trajectories([0, 1, 2], [[0.5, 0.5], [0.6, 0.4], [1.0, 0.0]], path, title="t")
    good = path.read_bytes()
    assert good.startswith(b"\x89PNG")
    fig = plt.figure()

    def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("renderer died")

    monkeypatch.setattr(fig, "savefig", broken)
    with pytest.raises(RuntimeError, match="renderer died"):
        save_png(fig, path)
    assert path.read_bytes() == good  # the earlier plot, whole
    assert [p.name for p in tmp_path.iterdir()] == ["traj.png"]  # no temp file left
    assert not plt.fignum_exists(fig.number)  # closed all the same
