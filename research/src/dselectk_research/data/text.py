"""A text corpus as a byte stream: the Python standard library's own source (``*.py`` files,
tests and site-packages left out), for byte-level language models
(:class:`~dselectk_research.char_lm.CharMoETransformer`). Nothing to download: every Python
installation carries it; the file list's hash identifies what was read."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["Corpus", "load_corpus"]


@dataclass
class Corpus:
    """Byte streams of the train and validation parts, and what was read."""

    train: Tensor
    val: Tensor
    files: list[str]
    """Paths relative to the stdlib folder, in reading order."""
    sha256: str
    """Hash of the file list (one relative path a line), identifying the corpus."""
    content_sha256: str
    """Hash of the bytes read."""
    root: str


def load_corpus(
    max_bytes: int = 1_500_000, val_fraction: float = 0.1, root: str | Path | None = None
) -> Corpus:
    """The first ``max_bytes`` of the stdlib's ``*.py`` files (sorted by relative path, tests
    and site-packages left out, whole files), as bytes; the last ``val_fraction`` of the stream
    is the validation part (a fixed, contiguous split). ``root``: another folder of ``*.py``
    files read the same way (default: the running Python's stdlib).

    Raises:
        ValueError: no ``*.py`` file under the folder.
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    found = [p for p in base.rglob("*.py") if not skip & set(p.relative_to(base).parts[:-1])]
    chunks: list[bytes] = []
    names: list[str] = []
    total = 0
    for p in sorted(found, key=lambda p: p.relative_to(base).as_posix()):
        if total >= max_bytes:
            break
        chunks.append(p.read_bytes())
        names.append(p.relative_to(base).as_posix())
        total += len(chunks[-1])
    if total == 0:
        raise ValueError(f"no *.py files under {base}")
    blob = b"".join(chunks)[:max_bytes]
    stream = torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()
    n_val = int(len(stream) * val_fraction)
    return Corpus(
        train=stream[: len(stream) - n_val],
        val=stream[len(stream) - n_val :],
        files=names,
        sha256=hashlib.sha256("\n".join(names).encode()).hexdigest(),
        content_sha256=hashlib.sha256(blob).hexdigest(),
        root=str(base),
    )
