"""The package's one atomic file writer.

Every writer here writes to a uniquely named temp file in the destination's folder
(``.<name>.<host>-<pid>.<random>.tmp``), flushes and fsyncs it, then renames it over the
destination with ``os.replace``. A reader therefore sees either the old file or the complete
new one, never a partial write. On any error (KeyboardInterrupt and SystemExit included) the
temp file is removed, the old file is left untouched, and the exception propagates. Parent
folders are created as needed.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from dselectk._testing import pause_point

#: the host part of temp-file names (dots become underscores): on a shared filesystem a
#: process can tell its own host's dead writers from other hosts' live ones
HOST = socket.gethostname().replace(".", "_")
_UMASK = os.umask(0)
os.umask(_UMASK)

__all__ = [
    "json_safe",
    "save_npz",
    "save_torch",
    "write_bytes",
    "write_json",
    "write_stream",
    "write_text",
]


def _atomic(path: str | Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Call ``write`` on a binary temp file beside ``path``, fsync, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = f"{HOST}-{os.getpid()}"  # at call time: forked processes have their own pid
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{writer}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; a written file gets the usual mode
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        pause_point(f"before-replace/{path.parent.name}")  # test-only; see dselectk._testing
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_stream(path: str | Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Call ``write`` on a binary file object whose content replaces ``path`` atomically once
    ``write`` returns (a figure's ``savefig``, say); returns the path.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from dselectk.io import write_stream
        >>> with tempfile.TemporaryDirectory() as d:
        ...     out = write_stream(Path(d) / "blob.bin", lambda f: f.write(b"ab"))
        ...     out.name, out.read_bytes()
        ('blob.bin', b'ab')
    """
    return _atomic(path, write)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from dselectk.io import write_bytes
        >>> with tempfile.TemporaryDirectory() as d:
        ...     out = write_bytes(Path(d) / "sub" / "a.bin", b"abc")  # parent folders are created
        ...     out.read_bytes(), [p.name for p in out.parent.iterdir()]  # no temp file left behind
        (b'abc', ['a.bin'])
    """
    return _atomic(path, lambda f: f.write(data))


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` atomically; returns the path.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from dselectk.io import write_text
        >>> with tempfile.TemporaryDirectory() as d:
        ...     write_text(Path(d) / "note.txt", "été").read_text(encoding="utf-8")
        'été'
    """
    return write_bytes(path, text.encode("utf-8"))


def json_safe(obj: Any) -> Any:
    """``obj`` made strict-JSON-ready: NaN/inf as None, keys as str, tuples and tensors as lists.

    Examples:
        >>> import torch
        >>> from dselectk.io import json_safe
        >>> json_safe({1: float("nan"), "t": (1, 2.5), "x": torch.tensor([[1, 2]])})
        {'1': None, 't': [1, 2.5], 'x': [[1, 2]]}
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return json_safe(obj.tolist())
    return obj


def write_json(path: str | Path, obj: Any, *, indent: int | None = 2) -> Path:
    """Write ``obj`` as JSON atomically: sorted keys, ``indent`` spaces, a final newline.

    NaN/inf are written as null and tensors as lists (see :func:`json_safe`), so the file is
    strict JSON. Returns the path.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from dselectk.io import write_json
        >>> with tempfile.TemporaryDirectory() as d:
        ...     out = write_json(Path(d) / "r.json", {"b": float("inf"), "a": (1, 2)}, indent=None)
        ...     print(out.read_text(), end="")  # sorted keys, strict JSON, a final newline
        {"a": [1, 2], "b": null}
    """
    return write_text(path, json.dumps(json_safe(obj), indent=indent, sort_keys=True) + "\n")


def save_torch(path: str | Path, obj: Any) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (e.g. a checkpoint); returns the path.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from pathlib import Path
        >>> from dselectk.io import save_torch
        >>> with tempfile.TemporaryDirectory() as d:
        ...     out = save_torch(Path(d) / "ckpt.pt", {"w": torch.ones(2, 3)})
        ...     torch.load(out)["w"].shape
        torch.Size([2, 3])
    """
    return _atomic(path, lambda f: torch.save(obj, f))


def save_npz(path: str | Path, **arrays: Any) -> Path:
    """``numpy.savez(**arrays)`` to ``path`` atomically (the name is used as given: no ``.npz`` is
    appended); returns the path.

    Examples:
        >>> import tempfile
        >>> import numpy as np
        >>> from pathlib import Path
        >>> from dselectk.io import save_npz
        >>> with tempfile.TemporaryDirectory() as d:
        ...     out = save_npz(Path(d) / "arrays.npz", x=np.zeros((2, 3)), y=np.arange(4))
        ...     with np.load(out) as f:
        ...         sorted(f.files), f["x"].shape
        (['x', 'y'], (2, 3))
    """
    import numpy as np

    return _atomic(path, lambda f: np.savez(f, **arrays))
