"""The research part imports without matplotlib and tqdm; a plot without matplotlib says what
to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BLOCK = "import sys; sys.modules['matplotlib'] = None; sys.modules['tqdm'] = None; "


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_research_imports_without_matplotlib_and_tqdm() -> None:
    out = _python(BLOCK + "import dselectk_research.plots, dselectk_research.cli; print('ok')")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    code = BLOCK + (
        "from dselectk_research.plots import plot_metric_vs\n"
        "try:\n"
        f"    plot_metric_vs({{'a': ([1, 2], [1, 2], None)}}, {str(tmp_path / 'x.png')!r},\n"
        "                   xlabel='T', ylabel='mse')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert "pip install matplotlib" in out.stdout
    assert not (tmp_path / "x.png").exists()
