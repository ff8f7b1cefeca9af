"""Result records: one JSON file per finished run, written atomically, so sweeps resume.

A sweep is a list of run configs. Each run is identified by a stable hash of its resolved config
(:func:`run_id`); its record ``runs/<run_id>.json`` is written with write-to-temp + ``os.replace``
only once the run has finished, so a killed sweep (Ctrl-C or kill -9) leaves either a complete
record or none, and the same command restarted skips finished runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "RunStore",
    "atomic_write_json",
    "atomic_write_text",
    "environment",
    "format_mean_se",
    "mean_se",
    "run_id",
    "summarize",
]


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON atomically (NaN/inf written as null)."""
    atomic_write_text(path, json.dumps(_clean(obj), indent=2, sort_keys=True) + "\n")


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return _clean(obj.tolist())
    return obj


def run_id(config: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit id of a resolved run config (key order does not matter)."""
    blob = json.dumps(_clean(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment() -> dict[str, Any]:
    """Package version, git commit, torch/python versions, CPU and thread count."""
    from dselectk import __version__

    return {
        "dselectk": __version__,
        "git_commit": _git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


class RunStore:
    """The ``runs/`` folder of a results directory.

    Args:
        root: the results directory; records go to ``root/runs/<run_id>.json``.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.runs = self.root / "runs"

    def path(self, rid: str) -> Path:
        return self.runs / f"{rid}.json"

    def done(self, config: Mapping[str, Any]) -> bool:
        """Whether a complete record of this config exists."""
        return self.path(run_id(config)).is_file()

    def save(self, config: Mapping[str, Any], metrics: Mapping[str, Any], **extra: Any) -> Path:
        """Write the record of a finished run (config, metrics, environment) atomically."""
        rid = run_id(config)
        record = {"run_id": rid, "config": dict(config), "metrics": dict(metrics)}
        record["environment"] = environment()
        record.update(extra)
        path = self.path(rid)
        atomic_write_json(path, record)
        return path

    def load(self) -> list[dict[str, Any]]:
        """All complete records, sorted by run id; an unreadable file raises a ValueError."""
        records: list[dict[str, Any]] = []
        if not self.runs.is_dir():
            return records
        for p in sorted(self.runs.glob("*.json")):
            try:
                records.append(json.loads(p.read_text(encoding="utf-8")))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}: not a valid run record ({e})") from None
        return records


def mean_se(values: Sequence[float]) -> dict[str, float | int]:
    """Mean, standard error (sample std / sqrt(n)) and count of the finite values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return {"mean": math.nan, "se": math.nan, "n": 0}
    mean = sum(xs) / n
    if n == 1:
        return {"mean": mean, "se": math.nan, "n": 1}
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return {"mean": mean, "se": math.sqrt(var / n), "n": n}


def format_mean_se(
    m: Mapping[str, Any] | None,
    digits: int = 2,
    *,
    scale: float = 1.0,
    missing: str = "–",
    show_n: bool = False,
) -> str:
    """``mean ± se`` of a summarised metric (a :func:`mean_se` dict), for tables.

    Args:
        m: ``{"mean", "se", "n"}`` or None.
        digits: decimals.
        scale: multiply mean and se (e.g. 1e4 for the paper's loss tables).
        missing: text when there is no finite mean.
        show_n: write ``(n=N)`` when there is no standard error (a single repetition).
    """
    if not m or not m.get("n", 1) or m.get("mean") is None:
        return missing
    mean = float(m["mean"]) * scale
    if not math.isfinite(mean):
        return missing
    se = m.get("se")
    if se is None or not math.isfinite(float(se)):
        return f"{mean:.{digits}f} (n={m.get('n', 1)})" if show_n else f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {float(se) * scale:.{digits}f}"


def summarize(
    records: Iterable[Mapping[str, Any]], group_by: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per distinct value of the config keys ``group_by``, with mean/se/n of each metric.

    Only numeric scalar metrics are summarised.
    """
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in records:
        key = tuple(json.dumps(r["config"].get(k)) for k in group_by)
        groups.setdefault(key, []).append(r)
    rows = []
    for key, recs in sorted(groups.items()):
        row: dict[str, Any] = {k: json.loads(v) for k, v in zip(group_by, key)}
        names = sorted(
            {m for r in recs for m, v in r["metrics"].items() if isinstance(v, (int, float))}
        )
        row["metrics"] = {m: mean_se([r["metrics"].get(m, math.nan) for r in recs]) for m in names}
        rows.append(row)
    return rows
