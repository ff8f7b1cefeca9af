"""Matplotlib, imported on first use (it is in the ``experiments`` extra, not the core install)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

__all__ = ["MISSING", "plt", "pyplot"]

MISSING = (
    "plotting needs matplotlib, which the core install of dselectk does not include: "
    "pip install 'dselectk[experiments]'"
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
