"""Matplotlib, imported on first use (it is in the ``experiments`` extra, not the core install)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, ParamSpec

__all__ = ["MISSING", "optional_plot", "plt", "pyplot"]

P = ParamSpec("P")
_NOTED: list[bool] = []

MISSING = (
    "plotting needs matplotlib, which the core install of dselectk does not include: "
    "pip install matplotlib"
)


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (PNG files, no display); a clear ImportError
    naming the extra when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(MISSING) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


class _LazyPyplot:
    """Stands for ``matplotlib.pyplot``; imports it when an attribute is first read."""

    def __getattr__(self, name: str) -> Any:
        return getattr(pyplot(), name)


plt: Any = _LazyPyplot()


def optional_plot(draw: Callable[P, Path]) -> Callable[P, Path | None]:
    """A plot a report may go without: without matplotlib it draws nothing, returns None and
    says once per process, in one line, how to get the plots (the report is still written:
    the core install's promise)."""

    @functools.wraps(draw)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Path | None:
        try:
            return draw(*args, **kwargs)
        except ImportError as e:
            if str(e) != MISSING:
                raise
            if not _NOTED:
                _NOTED.append(True)
                print(f"dselectk: plots skipped: {MISSING}", file=sys.stderr)
            return None

    return wrapper
