"""Routing telemetry: a training callback that logs what every gate of a model does.

:class:`RoutingTelemetry` is a :class:`~dselectk.training.GateObserver`, the training callbacks
that observe the gates (the other one, :class:`~dselectk.training.GateRecorder`, keeps the raw
gate weights in the run's history). Every ``every`` optimizer steps (and on no other step) it
finds the :class:`~dselectk.gates.base.Gate` modules of the model, measures them under
``torch.no_grad`` and writes one record: to TensorBoard (the ``tensorboard`` extra), to a
JSON-lines file (no extra needed; the automatic fallback), or both.

Gates are named after their module path, with ``/`` for ``.``; a bank of T gates
(``num_gates=T``) is T gates ``<path>/task<t>``, and the single gates of a ``gates`` list
(``MultiGateMoE(experts, [g0, g1, ...])``) are ``<path>/gates/task<i>`` too, so both forms of a
multi-gate MoE log ``gates/task0``, ``gates/task1``, ...

Static gates are measured as they are. Per-example gates (routers) need the input that reaches
them, which is not the model's input when a bottom, an embedding or earlier layers come first:
the callback runs the model once on a *probe* batch (by default the first ``probe_size`` rows of
the training inputs of the first logged step, kept so that successive records are comparable),
in eval mode (deterministic routing: no Gumbel noise, no dropout; the modules' modes are
restored after), with forward pre-hooks on the gates recording what they see. Tokens ``(..., d)``
count as examples, so "per example" below reads "per token" for a transformer MoE layer.

What one record holds, per gate (``weights`` w, n experts; per-example values are means over
the probe's examples/tokens); the gate-specific rows (``binary_fraction`` … ``expected_nonzeros``)
are what the gate's :meth:`~dselectk.gates.base.Gate.diagnostics` returns:

=====================  ======================================================================
``experts``            experts with a nonzero weight: per task (static), mean per example/token
``experts_used``       experts with a nonzero weight for at least one probe example (static:
                       = ``experts``); ``experts_used`` falling to 1 is collapse
``load`` (n,)          mean weight of each expert
``routed`` (n,)        fraction of the examples routed to each expert (weight > 0); static: 0/1
``weight_entropy``     entropy (nats) of w / Σw, mean over examples
``binary_fraction``    DSelect-k: fraction of the entries of S(Z) (per-example: S(Wx)) that are
                       exactly 0 or 1; COMET: of the trees' leaf probabilities
``binary``             DSelect-k: whether all of S(Z) is binary (1/0); per-example: the fraction
                       of examples whose S(Wx) is; COMET: whether every tree reaches one leaf
``selector_entropy``   DSelect-k: Σ_m h(S(z_m)) per selector (binary entropies, nats), mean over
                       selectors (and examples); softmax-selector ablation: entropy of σ(β/τ)
``collisions``         DSelect-k and the ablation: pairs i < j of selectors of one gate whose
                       argmax codes (S(z) > 1/2 bitwise; argmax of σ(β/τ)) pick the same expert
                       (codes >= n select none and never collide); per example: the mean
``expected_nonzeros``  Gumbel-softmax: Σ_i ψ_i, the expected number of kept experts
``<hyperparameter>``   every :class:`~dselectk.gates.base.HyperParameter` of the gate by name
                       (``gamma``, ``entropy_reg``, ``diversity``, ``temperature``,
                       ``sparsity_reg``): this gate's value when the bank holds one per gate
=====================  ======================================================================

A JSON-lines record is ``{"run": r, "step": s, "epoch": e, "wall_time": t, "gates": {name:
{metric: value}}}`` (``load`` and ``routed`` as lists; non-finite numbers as ``null``), one line
per logged step, flushed as it is written, so an interrupted run keeps what was logged. ``run``
is the :class:`RoutingTelemetry` object's :attr:`~RoutingTelemetry.run_id` (start time, host,
pid and a random part; or the one you pass): runs logging into one folder append to the same
``routing.jsonl`` and stay apart by it (:func:`read_jsonl` groups a file's records by run).
TensorBoard gets one scalar per tag ``<gate name>/<metric>``, lists as
``<gate name>/load/expert<i>`` and ``<gate name>/routed/expert<i>``, at ``global_step = s``,
flushed at every record; each run writes its own event file, whose name ends in
``.<run id>``.

Example::

    from dselectk.telemetry import RoutingTelemetry
    tel = RoutingTelemetry("runs/mmoe", every=50)  # TensorBoard, else JSON lines (warns)
    train(model, data, "mse", cfg, callbacks=[tel])
    tel.close()
    tel.records[-1]["gates"]["gates/task0"]["experts"]
"""

from __future__ import annotations

import json
import os
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dselectk.gates.base import Gate, hyperparameters
from dselectk.io import HOST, json_safe
from dselectk.training import GateObserver, History

__all__ = [
    "JsonlWriter",
    "RoutingTelemetry",
    "TensorBoardWriter",
    "find_gates",
    "flatten_record",
    "gate_names",
    "gate_stats",
    "new_run_id",
    "read_jsonl",
    "tensorboard_available",
]

BACKENDS = ("auto", "tensorboard", "jsonl", "both")
#: file name of the JSON-lines log inside ``log_dir``
JSONL_NAME = "routing.jsonl"


# --------------------------------------------------------------------------------------------
# measuring gates
# --------------------------------------------------------------------------------------------


def find_gates(model: nn.Module) -> list[tuple[str, Gate]]:
    """The gate modules of ``model`` with their base names (module path, ``/``-separated).

    A gate that is an entry of a ``gates`` list is named ``.../gates/task<i>``; the model itself,
    when it is a gate, is ``gate``. A bank's T gates are ``<name>/task<t>`` (see
    :func:`gate_names`).

    Examples:
        >>> from dselectk.gates import DSelectK
        >>> from dselectk.layers import StackedMLP
        >>> from dselectk.models import MultiGateMoE
        >>> model = MultiGateMoE(StackedMLP(4, 3, [8]), [DSelectK(4, 2), DSelectK(4, 2)],
        ...                      StackedMLP(2, 8, [1], final_activation=False))
        >>> [name for name, gate in find_gates(model)]
        ['gates/task0', 'gates/task1']
    """
    out = []
    for path, mod in model.named_modules():
        if not isinstance(mod, Gate):
            continue
        parts = path.split(".") if path else ["gate"]
        if len(parts) >= 2 and parts[-2] == "gates" and parts[-1].isdigit():
            parts[-1] = f"task{parts[-1]}"
        out.append(("/".join(parts), mod))
    return out


def gate_names(name: str, gate: Gate) -> list[str]:
    """One name per gate of ``gate``: ``[name]``, or ``name/task<t>`` for a bank.

    Examples:
        >>> from dselectk.gates import DSelectK
        >>> gate_names("gates", DSelectK(4, 2, num_gates=3))
        ['gates/task0', 'gates/task1', 'gates/task2']
        >>> gate_names("gate", DSelectK(4, 2))
        ['gate']
    """
    if gate.num_gates is None:
        return [name]
    return [f"{name}/task{t}" for t in range(gate.num_gates)]


def _entropy(p: Tensor, dim: int = -1) -> Tensor:
    return -torch.special.xlogy(p, p).sum(dim)


@torch.no_grad()
def gate_stats(gate: Gate, x: Tensor | None = None) -> list[dict[str, Any]]:
    """The telemetry of ``gate``: one dict per gate (T for a bank), metrics as in the module doc.

    Args:
        gate: any :class:`~dselectk.gates.base.Gate`; it is called as it is (put it in eval
            mode first for deterministic routing, e.g. of a Gumbel-softmax gate).
        x: the input reaching a per-example gate, ``(B, p)`` or tokens ``(..., p)``; ignored by
            static gates.

    Examples:
        >>> from dselectk.gates import DSelectK, SoftmaxGate
        >>> bank = gate_stats(DSelectK(4, 2, num_gates=2))  # static: one dict per gate of the bank
        >>> len(bank), len(bank[0]["load"]), bank[0]["gamma"]
        (2, 4, 1.0)
        >>> router = SoftmaxGate(4, in_features=3)  # per-example: needs its input (B, 3)
        >>> stats = gate_stats(router, torch.randn(5, 3))[0]
        >>> stats["experts"], round(sum(stats["load"]), 4)
        (4.0, 1.0)
    """
    if gate.static:
        x = None
    elif x is None:
        raise ValueError(f"{type(gate).__name__} is per-example: gate_stats needs its input x")
    else:
        x = x.reshape(-1, x.shape[-1])
    t_count, n = gate.num_gates or 1, gate.num_experts
    w = gate(x).weights.detach().float().reshape(-1, t_count, n)  # (N, T, n); static N = 1
    nz = w > 0
    metrics: dict[str, Tensor] = {
        "experts": nz.sum(-1).float().mean(0),
        "experts_used": nz.any(0).sum(-1).float(),
        "load": w.mean(0),
        "routed": nz.float().mean(0),
        "weight_entropy": _entropy(w / w.sum(-1, keepdim=True).clamp_min(1e-30)).mean(0),
    }
    metrics.update(gate.diagnostics(x))  # the gate-specific numbers (Gate.diagnostics)
    hps: dict[str, float | Tensor] = {}
    for name in hyperparameters(gate):
        try:
            hps[name] = getattr(gate, name)
        except AttributeError:  # declared but never set
            continue
    out: list[dict[str, Any]] = []
    for t in range(t_count):
        rec: dict[str, Any] = {}
        for key, val in metrics.items():
            rec[key] = val[t].tolist() if val.dim() == 2 else float(val[t])
        for key, hp in hps.items():
            rec[key] = float(hp[t]) if isinstance(hp, Tensor) and hp.dim() > 0 else float(hp)
        out.append(rec)
    return out


# --------------------------------------------------------------------------------------------
# writers
# --------------------------------------------------------------------------------------------


def flatten_record(record: Mapping[str, Any]) -> dict[str, float]:
    """A record's scalars by TensorBoard tag: ``<gate>/<metric>``, ``<gate>/load/expert<i>``.

    Examples:
        >>> flatten_record({"step": 3, "gates": {"gate": {"experts": 2.0, "load": [0.5, 0.5]}}})
        {'gate/experts': 2.0, 'gate/load/expert0': 0.5, 'gate/load/expert1': 0.5}
    """
    out: dict[str, float] = {}
    for gname, metrics in record["gates"].items():
        for key, val in metrics.items():
            if isinstance(val, (list, tuple)):
                for i, v in enumerate(val):
                    out[f"{gname}/{key}/expert{i}"] = float(v)
            else:
                out[f"{gname}/{key}"] = float(val)
    return out


def new_run_id() -> str:
    """A run id unique across runs, hosts and processes: ``<UTC start>-<host>-<pid>-<random>``.

    Examples:
        >>> run = new_run_id()  # e.g. 20260101T120000Z-host-4242-1a2b3c4d
        >>> run[8], run.endswith("Z", 0, 16), len(run.rsplit("-", 1)[1]), run == new_run_id()
        ('T', True, 8, False)
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{stamp}-{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def read_jsonl(path: str | Path) -> dict[str | None, list[dict[str, Any]]]:
    """The records of a ``routing.jsonl`` grouped by run id, in file order (runs in order of
    their first record; records written before run ids existed under ``None``).

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     w = JsonlWriter(Path(d) / "routing.jsonl")
        ...     for run, step in (("a", 1), ("b", 1), ("a", 2)):
        ...         w.write({"run": run, "step": step, "gates": {}})
        ...     w.close()
        ...     runs = read_jsonl(Path(d) / "routing.jsonl")
        >>> {run: [r["step"] for r in recs] for run, recs in runs.items()}
        {'a': [1, 2], 'b': [1]}
    """
    runs: dict[str | None, list[dict[str, Any]]] = {}
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                runs.setdefault(rec.get("run"), []).append(rec)
    return runs


class JsonlWriter:
    """Appends one JSON object per record to ``path`` (line-buffered, flushed at every record;
    non-finite numbers as ``null``).

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     w = JsonlWriter(Path(d) / "logs" / "routing.jsonl")  # folders are made
        ...     w.write({"run": "r", "step": 1, "gates": {"gate": {"load": [1.0, float("nan")]}}})
        ...     w.close()
        ...     print(w.path.read_text().strip())
        {"run": "r", "step": 1, "gates": {"gate": {"load": [1.0, null]}}}
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1, encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self._file.flush()

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def _summary_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter`` (ImportError without the tensorboard package)."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


def tensorboard_available() -> bool:
    """Whether TensorBoard logging works here (the ``tensorboard`` extra is installed).

    Examples:
        >>> backend = "tensorboard" if tensorboard_available() else "jsonl"
        >>> backend in ("tensorboard", "jsonl")
        True
    """
    try:
        _summary_writer_class()
    except ImportError:
        return False
    return True


class TensorBoardWriter:
    """Writes each record's scalars (:func:`flatten_record`) to TensorBoard event files, one
    file per writer whose name ends in ``.<run_id>`` (needs the ``tensorboard`` extra).

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     if tensorboard_available():
        ...         w = TensorBoardWriter(d, run_id="seed0")
        ...         w.write({"step": 1, "gates": {"gate": {"experts": 2.0}}})
        ...         w.close()
        ...         names = [p.name for p in Path(d).iterdir()]
        ...     else:  # without the extra nothing is written
        ...         names = ["events.out.tfevents.seed0"]
        >>> [n.startswith("events.out.tfevents") and n.endswith(".seed0") for n in names]
        [True]
    """

    def __init__(self, log_dir: str | Path, run_id: str | None = None) -> None:
        self.log_dir = Path(log_dir)
        suffix = {} if run_id is None else {"filename_suffix": f".{run_id}"}
        self._writer = _summary_writer_class()(log_dir=str(self.log_dir), **suffix)

    def write(self, record: Mapping[str, Any]) -> None:
        step, wall = int(record["step"]), record.get("wall_time")
        for tag, value in flatten_record(record).items():
            self._writer.add_scalar(tag, value, global_step=step, walltime=wall)
        self._writer.flush()

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# --------------------------------------------------------------------------------------------
# the callback
# --------------------------------------------------------------------------------------------


def _is_rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class RoutingTelemetry(GateObserver):
    """Logs the routing of every gate of the model every ``every`` steps (see the module doc):
    the :class:`~dselectk.training.GateObserver` that writes statistics.

    Args:
        log_dir: directory of the TensorBoard event files and/or of ``routing.jsonl``; None
            keeps the records in memory only (:attr:`records`).
        every: log after every ``every``-th optimizer step (``history.steps % every == 0``);
            nothing at all is done on the other steps.
        backend: "auto" (TensorBoard if installed, else JSON lines with a warning), "tensorboard"
            (ImportError without it), "jsonl" or "both".
        probe: fixed inputs of the model for the per-example gates (default: the first
            ``probe_size`` rows of ``batch.x`` at the first logged step, then kept).
        probe_size: rows of the default probe.
        forward: ``forward(model, probe)`` runs the model on the probe (default ``model(probe)``).
        keep_records: keep every record in :attr:`records` (small: a few numbers per gate).
        module: measure this module (gate names relative to it) instead of the model the
            training loop passes (e.g. the model inside a wrapper that ``train`` drives).
        run_id: this run's id, written into every record (``"run"``) and the TensorBoard event
            file's name (default :func:`new_run_id`: start time, host, pid, random); several
            runs logging into one ``log_dir`` stay apart by it.

    Under DDP only rank 0 measures and writes (the probe runs on the unwrapped module, no
    collectives). :meth:`log` measures and writes one record now (e.g. after training).

    Examples:
        >>> from dselectk.gates import DSelectK
        >>> from dselectk.layers import StackedMLP
        >>> from dselectk.models import MultiGateMoE
        >>> from dselectk.training import TaskData, TrainConfig, train
        >>> model = MultiGateMoE(StackedMLP(4, 3, [8]), DSelectK(4, 2, num_gates=2),
        ...                      StackedMLP(2, 8, [1], final_activation=False))
        >>> x = torch.randn(64, 3)
        >>> tel = RoutingTelemetry(None, every=4)  # in memory; a folder: TensorBoard/JSON lines
        >>> _ = train(model, TaskData(x, [x[:, :1], x[:, 1:2]]), "mse",
        ...           TrainConfig(epochs=2, batch_size=16, progress=False, search=None),
        ...           callbacks=[tel])
        >>> [r["step"] for r in tel.records], sorted(tel.records[-1]["gates"])
        ([4, 8], ['gates/task0', 'gates/task1'])
        >>> tel.records[-1]["gates"]["gates/task0"]["load"]  # mean weight per expert
        [...]
    """

    def __init__(
        self,
        log_dir: str | Path | None = None,
        every: int = 100,
        *,
        backend: str = "auto",
        probe: Tensor | None = None,
        probe_size: int = 128,
        forward: Callable[[nn.Module, Any], Any] | None = None,
        keep_records: bool = True,
        module: nn.Module | None = None,
        run_id: str | None = None,
    ) -> None:
        super().__init__(every, probe=probe, probe_size=probe_size, forward=forward, module=module)
        if run_id is None:
            run_id = new_run_id()
        elif not isinstance(run_id, str) or not run_id or run_id != run_id.strip():
            raise ValueError(f"run_id must be a non-empty string without edge spaces: {run_id!r}")
        elif any(c in run_id for c in "/\\\0"):
            raise ValueError(
                f"run_id must not hold '/', '\\' or NUL (a file name part): {run_id!r}"
            )
        self.run_id: str = run_id
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.keep_records = bool(keep_records)
        self.records: list[dict[str, Any]] = []
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.writers: list[JsonlWriter | TensorBoardWriter] = []
        self._warned: set[str] = set()
        if self.log_dir is None or not _is_rank0():
            self.backend = "none"
            return
        if backend == "auto":
            if tensorboard_available():
                backend = "tensorboard"
            else:
                backend = "jsonl"
                warnings.warn(
                    "RoutingTelemetry: tensorboard is not installed (pip install "
                    f"'dselectk[tensorboard]'); logging to {self.log_dir / JSONL_NAME} instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self.backend = backend
        if backend in ("tensorboard", "both"):
            self.writers.append(TensorBoardWriter(self.log_dir, run_id=self.run_id))
        if backend in ("jsonl", "both"):
            self.writers.append(JsonlWriter(self.log_dir / JSONL_NAME))

    @property
    def jsonl_path(self) -> Path | None:
        """The JSON-lines file, when one is written."""
        for w in self.writers:
            if isinstance(w, JsonlWriter):
                return w.path
        return None

    # -- Callback ---------------------------------------------------------------------------
    def observe(self, model: nn.Module, history: History, batch: Any) -> None:
        """Log one record at ``history.steps`` (:meth:`log`)."""
        self.log(model, history.steps, batch=batch, epoch=len(history.train_loss) + 1)

    def on_epoch(self, model: nn.Module, epoch: int, history: History) -> None:
        self.flush()

    def on_train_end(self, model: nn.Module, history: History) -> None:
        """Close the writers when the run ends: one telemetry object per training run (records
        logged after this are kept in memory only)."""
        self.close()

    # -- logging ----------------------------------------------------------------------------
    def log(
        self, model: nn.Module, step: int, *, batch: Any = None, epoch: int | None = None
    ) -> dict[str, Any] | None:
        """Measure every gate now and write one record (returned; None on ranks > 0)."""
        if not _is_rank0():
            return None
        module = self.target(model)
        found = find_gates(module)
        if not found:
            self._warn_once("nogates", "RoutingTelemetry: the model holds no dselectk Gate")
        inputs: dict[int, Tensor] = {}
        per_example = [g for _, g in found if not g.static]
        if per_example:
            inputs = self._probe_inputs(module, per_example, batch)
        gates: dict[str, dict[str, Any]] = {}
        for name, gate in found:
            if gate.static:
                stats = self._stats_in_eval(gate, None)
            elif id(gate) in inputs:
                stats = self._stats_in_eval(gate, inputs[id(gate)])
            else:
                self._warn_once(
                    name,
                    f"RoutingTelemetry: the probe forward never reached the per-example gate "
                    f"{name!r}; it is not logged",
                )
                continue
            gates.update(zip(gate_names(name, gate), stats))
        record: dict[str, Any] = {
            "run": self.run_id,
            "step": int(step),
            "epoch": epoch,
            "wall_time": time.time(),
            "gates": gates,
        }
        for w in self.writers:
            w.write(record)
        if self.keep_records:
            self.records.append(record)
        return record

    @staticmethod
    def _stats_in_eval(gate: Gate, x: Tensor | None) -> list[dict[str, Any]]:
        was = gate.training
        gate.train(False)
        try:
            return gate_stats(gate, x)
        finally:
            gate.train(was)

    def _probe_inputs(self, module: nn.Module, gates: list[Gate], batch: Any) -> dict[int, Tensor]:
        """What each per-example gate sees when the model runs on the probe (eval, no grad)."""
        probe = self.probe_for(batch)
        seen: dict[int, list[Tensor]] = {}

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else kwargs.get("x")
            if isinstance(x, Tensor):
                seen.setdefault(id(mod), []).append(x.detach().reshape(-1, x.shape[-1]))

        handles = [g.register_forward_pre_hook(hook, with_kwargs=True) for g in gates]
        try:
            self.run_probe(module, probe)
        finally:
            for h in handles:
                h.remove()
        return {k: v[0] if len(v) == 1 else torch.cat(v) for k, v in seen.items()}

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def flush(self) -> None:
        """Flush every writer."""
        for w in self.writers:
            w.flush()

    def close(self) -> None:
        """Close every writer (further records are kept in memory only)."""
        for w in self.writers:
            w.close()
        self.writers = []

    def __enter__(self) -> RoutingTelemetry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
