"""Progress bars without a hard dependency on ``tqdm``.

``from dselectk.progress import tqdm`` is a drop-in for ``from tqdm.auto import tqdm``: when the
``tqdm`` package is installed (``pip install tqdm``, or the ``progress`` extra) it *is*
``tqdm.auto.tqdm``;
otherwise it is :class:`SilentTqdm`, which accepts the same arguments, shows nothing and supports
what the package uses (iteration, ``update``, ``close``, ``set_postfix``, ``set_postfix_str``,
``set_description``, ``refresh``, ``n``, ``total``, context-manager use, and the class methods
``write``, ``set_lock`` and ``get_lock``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["HAVE_TQDM", "SilentTqdm", "tqdm"]


class SilentTqdm:
    """A progress bar that draws nothing (the fallback when ``tqdm`` is not installed)."""

    _lock: Any = None

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        desc: str | None = None,
        total: float | None = None,
        leave: bool | None = True,
        file: Any = None,
        ncols: int | None = None,
        mininterval: float = 0.1,
        maxinterval: float = 10.0,
        miniters: float | None = None,
        ascii: bool | str | None = None,
        disable: bool | None = False,
        unit: str = "it",
        unit_scale: bool | float = False,
        dynamic_ncols: bool = False,
        smoothing: float = 0.3,
        bar_format: str | None = None,
        initial: float = 0,
        position: int | None = None,
        postfix: Any = None,
        **kwargs: Any,
    ) -> None:
        self.iterable = iterable
        self.desc = desc or ""
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except (TypeError, AttributeError):
                total = None
        self.total = total
        self.leave = leave
        self.disable = bool(disable)
        self.unit = unit
        self.position = position
        self.n = initial
        self.postfix = postfix

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("'SilentTqdm' object without an iterable is not iterable")
        for obj in self.iterable:
            yield obj
            self.n += 1

    def __len__(self) -> int:
        if self.total is not None:
            return int(self.total)
        return len(self.iterable)  # type: ignore[arg-type]

    def __enter__(self) -> SilentTqdm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: float = 1) -> bool | None:
        self.n += n
        return None

    def close(self) -> None:
        pass

    def clear(self, *args: Any, **kwargs: Any) -> None:
        pass

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        pass

    def reset(self, total: float | None = None) -> None:
        self.n = 0
        if total is not None:
            self.total = total

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        items = dict(ordered_dict or {})
        items.update(kwargs)
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    @classmethod
    def write(cls, s: str, file: Any = None, end: str = "\n", nolock: bool = False) -> None:
        """Print ``s`` (to stdout unless ``file`` is given), as ``tqdm.write`` does."""
        fp = file if file is not None else sys.stdout
        fp.write(s)
        fp.write(end)

    @classmethod
    def set_lock(cls, lock: Any) -> None:
        cls._lock = lock

    @classmethod
    def get_lock(cls) -> Any:
        if cls._lock is None:
            cls._lock = threading.RLock()
        return cls._lock


try:
    from tqdm.auto import tqdm
except ImportError:  # tqdm is optional (the `progress` extra)
    HAVE_TQDM = False
    tqdm = SilentTqdm
else:
    HAVE_TQDM = True
