"""Deployment: ONNX and ``torch.export`` with verification, and freezing a converged model.

* :func:`to_onnx` writes an ONNX file and :func:`export_program` returns a
  :class:`torch.export.ExportedProgram`; both **verify** the result on fresh random (finite)
  inputs at several batch sizes, up to :data:`VERIFY_BATCH_SIZES`' 1024, against PyTorch eager
  and raise :class:`ExportVerificationError` when they differ or when either gives a NaN or
  an infinity the other does not (a wrong graph is never returned silently). Models are
  exported in eval mode (gates with training-time randomness, noisy Top-k and
  Gumbel-softmax, export their deterministic eval behaviour). An example input holding NaN or
  inf is refused (:class:`ValueError`). The ONNX file is written beside ``path`` under a
  temporary name, verified, then renamed over ``path``: a failed export leaves an earlier
  file at ``path`` as it was.
* :func:`freeze` turns a model whose static gates have converged (binary S(Z)) into an
  inference model holding only the experts some task uses, each static gate replaced by its
  fixed weights; outputs are unchanged.

Routing and export: the expert mixer skips unused experts by reading the gate weights' values
(:mod:`dselectk.layers.mixer`). While tracing or exporting it takes the dense masked mix instead
(every expert computed, weighted by its gate weight, which is exactly zero where unused): the
same outputs for every input. A frozen model's selection is part of its structure (a static
gather), so exporting it computes only the kept experts.

ONNX needs the ``export`` extra: ``pip install 'dselectk[export]'`` (onnx, onnxruntime and
onnxscript, which the ``torch.export``-based ONNX exporter uses).
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import operator
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dselectk._validate import check_flag
from dselectk.gates.base import Gate, check_positive_int
from dselectk.gates.fixed import FixedGate
from dselectk.io import HOST
from dselectk.layers.experts import ExpertList, StackedMLP
from dselectk.models.moe import MoE, MoEOutput, MultiGateMoE, MultiTaskOutput

__all__ = [
    "DEFAULT_OPSET",
    "ExportVerificationError",
    "FixedGate",
    "SelectedExperts",
    "export_program",
    "freeze",
    "to_onnx",
    "verify",
]

#: ONNX opset of :func:`to_onnx` (torch 2.13's default)
DEFAULT_OPSET = 20
#: batch sizes of the fresh inputs the exported model is checked on (a large one too: a
#: graph whose dynamic batch carries a size guard fails there, not in a user's hands)
VERIFY_BATCH_SIZES = (16, 7, 1, 1024)
#: batches up to this size get fresh random rows; larger ones repeat those rows
FRESH_MAX_ROWS = 64

Inputs = Tensor | Sequence[Tensor]
Sampler = Callable[[int], Sequence[Tensor]]


class ExportVerificationError(RuntimeError):
    """The exported model does not compute what the PyTorch model computes.

    Examples:
        >>> import torch
        >>> from dselectk.export import ExportVerificationError, verify
        >>> model = torch.nn.Linear(4, 2)
        >>> wrong = lambda xs: [torch.zeros(len(xs[0]), 2)]  # an "export" that lost the weights
        >>> verify(wrong, model, torch.randn(8, 4))
        Traceback (most recent call last):
            ...
        dselectk.export.ExportVerificationError: batch 16: output 0 differs from PyTorch ...
    """


# -- inputs and outputs -------------------------------------------------------------------------
class _Predictions(nn.Module):
    """The model with its predictions as a flat tuple of tensors (what export writes out)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.training = False  # the wrapper only; the model's modes are left alone

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        return _flatten(self.model(*args))


def _flatten(out: Any) -> tuple[Tensor, ...]:
    if isinstance(out, MoEOutput):
        return (out.output,)
    if isinstance(out, MultiTaskOutput):
        return tuple(out.outputs)
    if isinstance(out, Tensor):
        return (out,)
    if isinstance(out, (tuple, list)):
        return tuple(t for o in out for t in _flatten(o))
    raise TypeError(f"cannot export an output of type {type(out).__name__}")


def _as_tuple(inputs: Inputs) -> tuple[Tensor, ...]:
    args = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    if not args or not all(isinstance(a, Tensor) and a.dim() >= 1 for a in args):
        raise TypeError("example_inputs must be a tensor or a sequence of tensors (batch first)")
    if len({a.shape[0] for a in args}) != 1:
        raise ValueError("all example inputs must have the same batch size (dim 0)")
    if args[0].shape[0] == 0:
        raise ValueError(
            "example_inputs have 0 rows (dim 0): export is traced and verified on at least "
            "one example"
        )
    _check_finite(args, "example_inputs")
    return args


def _check_finite(args: Sequence[Tensor], name: str) -> None:
    """ValueError when a floating tensor of ``args`` holds NaN or inf (naming ``name[i]``)."""
    for i, a in enumerate(args):
        if a.is_floating_point() or a.is_complex():
            bad = int((~torch.isfinite(a)).sum())
            if bad:
                raise ValueError(
                    f"{name}[{i}] holds {bad} non-finite value(s) (NaN or inf): export is "
                    "traced and verified on finite inputs only; pass finite example inputs"
                )


def fresh_inputs(example: Sequence[Tensor], batch: int, generator: torch.Generator) -> list[Tensor]:
    """Random inputs like ``example`` with ``batch`` rows, never equal to the example.

    Floating inputs: Gaussian with the example's mean and standard deviation per feature.
    Integer and boolean inputs (ids, categories): rows of the example drawn at random, each
    column independently (so the values stay valid ids).
    """
    out = []
    for a in example:
        if a.is_floating_point():
            mean = a.mean(dim=0, keepdim=True)
            std = a.std(dim=0, keepdim=True) if a.shape[0] > 1 else torch.ones_like(mean)
            noise = torch.randn((batch, *a.shape[1:]), generator=generator, dtype=a.dtype)
            out.append(mean + noise.to(a.device) * std.clamp_min(1e-3))
        else:
            flat = a.reshape(a.shape[0], -1)
            rows = torch.randint(0, a.shape[0], (batch, flat.shape[1]), generator=generator)
            cols = torch.arange(flat.shape[1]).expand(batch, -1)
            out.append(flat[rows.to(a.device), cols.to(a.device)].view(batch, *a.shape[1:]))
    return out


def _verify_inputs(
    args: Sequence[Tensor],
    batch: int,
    gen: torch.Generator,
    sampler: Sampler | None,
    drawn: list[list[Tensor]],
) -> list[Tensor]:
    """Finite inputs for the check at ``batch``: the sampler's, or :func:`fresh_inputs`.

    A batch above :data:`FRESH_MAX_ROWS` repeats the rows drawn for the smaller batches
    (``drawn``, appended to here): it checks that the graph takes that many rows and computes
    each as at a small batch, without drawing new near-ties of ill-conditioned gates (e.g.
    softmax over huge logits) whose float32 rounding differs between runtimes.
    """
    if sampler is not None:
        xs = list(sampler(batch))
        _check_finite(xs, f"input_sampler({batch})")
        return xs
    if batch > FRESH_MAX_ROWS:
        if not drawn:
            drawn.append(_verify_inputs(args, VERIFY_BATCH_SIZES[0], gen, None, []))
        pool = [torch.cat(cols) for cols in zip(*drawn)]
        reps = -(-batch // pool[0].shape[0])
        return [p.repeat(reps, *([1] * (p.dim() - 1)))[:batch] for p in pool]
    xs = fresh_inputs(args, batch, gen)
    for i, x in enumerate(xs):
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise ValueError(
                f"fresh inputs like example_inputs[{i}] overflow {x.dtype} (its mean or spread "
                "is too large); pass input_sampler= to verify on your own inputs"
            )
    if batch:
        drawn.append(xs)
    return xs


def _trace_example(args: tuple[Tensor, ...], dynamic_batch: bool) -> tuple[Tensor, ...]:
    """The example to trace: batch >= 2 for a dynamic batch (exporters specialise 0 and 1)."""
    if dynamic_batch and args[0].shape[0] < 2:
        return tuple(torch.cat([a, a]) for a in args)
    return args


def _compare(
    got: Sequence[Any], want: Sequence[Tensor], atol: float, rtol: float, where: str
) -> float:
    """The largest difference of the finite outputs; ExportVerificationError beyond the
    tolerance, and on any NaN (NaN never equals NaN: a check on NaN proves nothing) or any
    infinity the other side does not give with the same sign."""
    if len(got) != len(want):
        raise ExportVerificationError(f"{where}: {len(got)} outputs, PyTorch gives {len(want)}")
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        g_t = torch.as_tensor(g).to(w.device, w.dtype)
        if g_t.shape != w.shape:
            raise ExportVerificationError(
                f"{where}: output {i} has shape {tuple(g_t.shape)}, PyTorch {tuple(w.shape)}"
            )
        fin_g, fin_w = torch.isfinite(g_t), torch.isfinite(w)
        nonfinite = (~fin_g | ~fin_w) & (g_t != w)  # NaN anywhere, or inf against another value
        if bool(nonfinite.any()):
            raise ExportVerificationError(
                f"{where}: output {i} is not finite on finite inputs (PyTorch eager: "
                f"{int((~fin_w).sum())} NaN/inf value(s), the exported model: "
                f"{int((~fin_g).sum())}, {int(nonfinite.sum())} not matching); a comparison "
                "with NaN or inf proves nothing, so the exported graph is not accepted"
            )
        both = fin_g & fin_w
        err = torch.where(both, g_t - w, torch.zeros_like(w)).abs()
        bad = err > atol + rtol * torch.where(both, w, torch.zeros_like(w)).abs()
        if err.numel():
            worst = max(worst, float(err.max()))
        if bool(bad.any()):
            raise ExportVerificationError(
                f"{where}: output {i} differs from PyTorch by up to {float(err.max()):.3g} "
                f"(atol={atol:g}, rtol={rtol:g}); the exported graph is wrong for new inputs"
            )
    return worst


def _check_tolerances(batch_sizes: Sequence[int], atol: float, rtol: float) -> tuple[int, ...]:
    """Refuse a verification that would check nothing: tolerances that are NaN, infinite or
    negative, or no batch size >= 1 to run."""
    for name, value in (("atol", atol), ("rtol", rtol)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a finite number >= 0, got {type(value).__name__}")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence):
        raise TypeError(
            f"batch_sizes must be a non-empty sequence of ints >= 1, got "
            f"{type(batch_sizes).__name__}"
        )
    if len(batch_sizes) == 0:
        raise ValueError("batch_sizes must be a non-empty sequence of ints >= 1, got []")
    sizes = []
    for b in batch_sizes:
        if isinstance(b, bool) or not hasattr(type(b), "__index__"):
            raise TypeError(f"batch_sizes must hold ints >= 1, got {b!r}")
        if operator.index(b) < 1:
            raise ValueError(f"batch_sizes must hold ints >= 1, got {list(batch_sizes)}")
        sizes.append(operator.index(b))
    return tuple(sizes)


def verify(
    run: Callable[[list[Tensor]], Sequence[Any]],
    model: nn.Module,
    example_inputs: Inputs,
    *,
    batch_sizes: Sequence[int] = VERIFY_BATCH_SIZES,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    input_sampler: Sampler | None = None,
    seed: int = 0,
) -> float:
    """Check ``run(inputs)`` against ``model`` in eval mode on fresh inputs at ``batch_sizes``.

    Returns the largest absolute difference; raises :class:`ExportVerificationError` beyond
    ``atol + rtol·|expected|``, on a NaN or an unmatched infinity in either output (or when
    ``run`` fails). The inputs are finite: a non-finite example input or sampled input is
    refused with :class:`ValueError`, and so are ``atol``/``rtol`` that are not finite numbers
    >= 0 and ``batch_sizes`` without a size >= 1 (a check that would check nothing).

    Examples:
        >>> import copy
        >>> import torch
        >>> from torch import nn
        >>> from dselectk.export import verify
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> double = copy.deepcopy(model).double()  # stands in for an exported copy of the model
        >>> run = lambda xs: [double(xs[0].double()).float()]  # inputs (B, 4) -> outputs [(B, 2)]
        >>> worst = verify(run, model, torch.randn(3, 4))  # at batch sizes 16, 7, 1, 1024
        >>> worst < 1e-5
        True
    """
    batch_sizes = _check_tolerances(batch_sizes, atol, rtol)
    seed = check_positive_int("seed", seed, 0)
    args = _as_tuple(example_inputs)
    gen = torch.Generator().manual_seed(seed)
    wrapped = _Predictions(model)
    worst = 0.0
    drawn: list[list[Tensor]] = []
    with _eval(model), torch.no_grad():
        for b in batch_sizes:
            xs = _verify_inputs(args, b, gen, input_sampler, drawn)
            want = wrapped(*xs)
            try:
                got = run(xs)
            except Exception as e:  # onnxruntime / ExportedProgram refusing new inputs
                raise ExportVerificationError(
                    f"batch {b}: the exported model fails on fresh inputs: {e}"
                ) from e
            worst = max(worst, _compare(got, want, atol, rtol, f"batch {b}"))
    return worst


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[nn.Module]:
    """Eval mode inside the block, every submodule's previous mode restored afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, mode in modes:
            m.training = mode


# -- ONNX -----------------------------------------------------------------------------------
def _require_onnx() -> Any:
    try:
        import onnx  # noqa: F401
        import onnxruntime
    except ImportError as e:
        raise ImportError(
            f"ONNX export needs onnx and onnxruntime ({e.name} is missing): "
            "pip install 'dselectk[export]'"
        ) from e
    return onnxruntime


def to_onnx(
    model: nn.Module,
    example_inputs: Inputs,
    path: str | os.PathLike[str],
    *,
    opset: int = DEFAULT_OPSET,
    dynamic_batch: bool = True,
    exporter: Literal["dynamo", "torchscript"] = "dynamo",
    verify_export: bool = True,
    batch_sizes: Sequence[int] = VERIFY_BATCH_SIZES,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    input_sampler: Sampler | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> Path:
    """Export ``model`` (in eval mode) to an ONNX file and check it with onnxruntime.

    The graph's outputs are the model's predictions: ``MoEOutput.output``, the tensors of
    ``MultiTaskOutput.outputs``, or the (flattened) tensors the model returns.

    Args:
        model: e.g. :class:`~dselectk.models.MoE` or :class:`~dselectk.models.MultiGateMoE`
            (or a :func:`freeze` d one).
        example_inputs: a tensor or a sequence of tensors, batch first.
        path: where to write the ``.onnx`` file.
        opset: ONNX opset version.
        dynamic_batch: make dim 0 of every input (and output) dynamic.
        exporter: ``"dynamo"`` (``torch.onnx.export(dynamo=True)``, via ``torch.export``;
            needs onnxscript) or ``"torchscript"`` (the tracing exporter, ``dynamo=False``).
        verify_export: run the file with onnxruntime on fresh inputs at ``batch_sizes`` (only
            the example's batch size when ``dynamic_batch=False``) and compare with PyTorch
            eager; on a mismatch :class:`ExportVerificationError` is raised and nothing is
            written (the export goes to a temp file beside ``path``, renamed over ``path`` once
            verified: an earlier file at ``path`` is kept as it was).
        atol, rtol: tolerance of the comparison (finite numbers >= 0; ``batch_sizes`` must
            hold at least one size >= 1).
        input_sampler: ``batch -> inputs``, to verify on your own data instead of random inputs
            shaped like the example (see :func:`fresh_inputs`).
        input_names, output_names: names in the graph (default ``input_i``, ``output_i``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> import onnxruntime
        >>> import torch
        >>> from dselectk import DSelectK, MultiGateMoE
        >>> from dselectk.export import freeze, to_onnx
        >>> from dselectk.layers import StackedMLP
        >>> gates = DSelectK(num_experts=8, k=2, num_gates=2)
        >>> towers = StackedMLP(2, 32, [1], final_activation=False)
        >>> model = MultiGateMoE(StackedMLP(8, 16, [32]), gates, towers)
        >>> gates.set_selection(torch.tensor([[0, 3], [3, 5]]))  # as training leaves it
        >>> with tempfile.TemporaryDirectory() as d:  # the file is verified with onnxruntime
        ...     path = to_onnx(freeze(model), torch.randn(4, 16), Path(d) / "model.onnx")
        ...     session = onnxruntime.InferenceSession(path)
        ...     [y.shape for y in session.run(None, {"input_0": torch.randn(5, 16).numpy()})]
        [(5, 1), (5, 1)]
    """
    _check_tolerances(batch_sizes, atol, rtol)
    ort = _require_onnx()
    args = _as_tuple(example_inputs)
    path = Path(path)
    if exporter not in ("dynamo", "torchscript"):
        raise ValueError(f"exporter must be 'dynamo' or 'torchscript', got {exporter!r}")
    with _temp_beside(path) as tmp:
        _write_onnx(model, args, tmp, opset, dynamic_batch, exporter, input_names, output_names)
        if verify_export:
            sizes = batch_sizes if dynamic_batch else (args[0].shape[0],)
            try:
                session = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
            except Exception as e:  # an invalid graph (shapes, types)
                raise ExportVerificationError(
                    f"onnxruntime cannot load the exported model (nothing written to {path}): {e}"
                ) from e
            feeds = [i.name for i in session.get_inputs()]

            def run(xs: list[Tensor]) -> list[Any]:
                return session.run(None, {n: x.cpu().numpy() for n, x in zip(feeds, xs)})

            try:
                verify(
                    run, model, args, batch_sizes=sizes, atol=atol, rtol=rtol,
                    input_sampler=input_sampler,
                )  # fmt: skip
            except ExportVerificationError as e:
                raise ExportVerificationError(
                    f"{e} (nothing written to {path}; a file already there is kept)"
                ) from e
        os.replace(tmp, path)
    return path


@contextlib.contextmanager
def _temp_beside(path: Path) -> Iterator[Path]:
    """A fresh temp file name in ``path``'s folder (as :mod:`dselectk.io` names them), removed
    afterwards unless it was renamed: the export is written there and moved over ``path`` only
    once it is verified, so a failure never touches a file already at ``path``."""
    if path.is_dir() or not path.name or path.name in (".", ".."):
        raise ValueError(f"path {str(path)!r} is a directory; expected the file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.{HOST}-{os.getpid()}.", suffix=".tmp"
    )
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(name, 0o666 & ~umask)  # mkstemp makes 0600 files; a written file gets the usual mode
    tmp = Path(name)
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def _write_onnx(
    model: nn.Module,
    args: tuple[Tensor, ...],
    path: Path,
    opset: int,
    dynamic_batch: bool,
    exporter: str,
    input_names: Sequence[str] | None,
    output_names: Sequence[str] | None,
) -> None:
    """Export ``model`` (eval mode, predictions as a tuple) to the ONNX file ``path``."""
    wrapped = _Predictions(model)
    with _eval(model), torch.no_grad():
        n_out = len(wrapped(*args))
        trace_args = _trace_example(args, dynamic_batch)
        names = list(input_names or [f"input_{i}" for i in range(len(args))])
        outs = list(output_names or [f"output_{i}" for i in range(n_out)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.simplefilter("ignore", DeprecationWarning)  # the tracing exporter, chosen
            if exporter == "dynamo":
                shapes = _dynamic_shapes(len(args)) if dynamic_batch else None
                program = torch.onnx.export(
                    wrapped,
                    trace_args,
                    dynamo=True,
                    opset_version=opset,
                    input_names=names,
                    output_names=outs,
                    dynamic_shapes=shapes,
                    verbose=False,
                )
                assert program is not None
                program.save(str(path))
            else:
                axes = {n: {0: "batch"} for n in names + outs} if dynamic_batch else None
                torch.onnx.export(
                    wrapped,
                    trace_args,
                    str(path),
                    dynamo=False,
                    opset_version=opset,
                    input_names=names,
                    output_names=outs,
                    dynamic_axes=axes,
                )


def _dynamic_shapes(n_inputs: int) -> tuple[tuple[dict[int, Any], ...]]:
    """Dim 0 of every input dynamic (one entry: the wrapper's ``*args``)."""
    batch = torch.export.Dim.DYNAMIC
    return (tuple({0: batch} for _ in range(n_inputs)),)


# -- torch.export -----------------------------------------------------------------------------
def export_program(
    model: nn.Module,
    example_inputs: Inputs,
    *,
    dynamic_batch: bool = True,
    verify_export: bool = True,
    batch_sizes: Sequence[int] = VERIFY_BATCH_SIZES,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    input_sampler: Sampler | None = None,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``model`` (eval mode, predictions as a tuple), verified.

    The program's ``module()`` is run on fresh inputs at ``batch_sizes`` and compared with
    PyTorch eager; :class:`ExportVerificationError` on a mismatch. Arguments as
    :func:`to_onnx`.

    Examples:
        >>> import torch
        >>> from dselectk import DSelectK, MultiGateMoE
        >>> from dselectk.export import export_program, freeze
        >>> from dselectk.layers import StackedMLP
        >>> gates = DSelectK(num_experts=8, k=2, num_gates=2)
        >>> towers = StackedMLP(2, 32, [1], final_activation=False)
        >>> model = MultiGateMoE(StackedMLP(8, 16, [32]), gates, towers)
        >>> gates.set_selection(torch.tensor([[0, 3], [3, 5]]))  # as training leaves it
        >>> program = export_program(freeze(model), torch.randn(4, 16))  # verified against eager
        >>> [y.shape for y in program.module()(torch.randn(5, 16))]  # any batch: 2 tasks' (B, 1)
        [torch.Size([5, 1]), torch.Size([5, 1])]
    """
    _check_tolerances(batch_sizes, atol, rtol)
    args = _as_tuple(example_inputs)
    wrapped = _Predictions(model)
    with _eval(model), torch.no_grad():
        shapes = _dynamic_shapes(len(args)) if dynamic_batch else None
        program = torch.export.export(
            wrapped, _trace_example(args, dynamic_batch), dynamic_shapes=shapes
        )
    if verify_export:
        sizes = batch_sizes if dynamic_batch else (args[0].shape[0],)
        runner = program.module()
        verify(
            lambda xs: runner(*xs), model, args, batch_sizes=sizes, atol=atol, rtol=rtol,
            input_sampler=input_sampler,
        )  # fmt: skip
    return program


# -- freezing -----------------------------------------------------------------------------------
class SelectedExperts(nn.Module):
    """Members ``members`` of an expert bank, as a bank (a static gather, export-safe).

    Used by :func:`freeze` for banks it cannot slice (e.g. CNN banks): the full bank's
    parameters stay, only the selected members are computed.

    Examples:
        >>> import torch
        >>> from dselectk.export import SelectedExperts
        >>> from dselectk.layers import StackedMLP
        >>> bank = StackedMLP(8, 4, [16])  # 8 experts: (B, 4) -> (8, B, 16)
        >>> kept = SelectedExperts(bank, torch.tensor([1, 5]))  # experts 1 and 5 as a bank of 2
        >>> x = torch.randn(3, 4)
        >>> kept(x).shape, torch.equal(kept(x), bank(x, torch.tensor([1, 5])))
        (torch.Size([2, 3, 16]), True)
    """

    members: Tensor

    def __init__(self, bank: nn.Module, members: Tensor) -> None:
        super().__init__()
        self.bank = bank
        self.register_buffer("members", members.detach().to(torch.long).clone())
        self.num_members = int(members.numel())

    def forward(self, x: Tensor, members: Tensor | None = None) -> Tensor:
        idx = self.members if members is None else self.members[members]
        return self.bank(x, idx)


def _select_experts(bank: nn.Module, keep: Tensor) -> nn.Module:
    """A bank of the members ``keep`` of ``bank`` (fewer parameters when it can be sliced)."""
    if isinstance(bank, StackedMLP):
        new = copy.deepcopy(bank)
        for plist in (new.weights, new.biases):
            for i, p in enumerate(plist):
                plist[i] = nn.Parameter(p.detach()[keep].clone(), requires_grad=p.requires_grad)
        new.num_members = int(keep.numel())
        return new
    if isinstance(bank, ExpertList):
        return ExpertList([bank.members[i] for i in keep.tolist()])
    return SelectedExperts(bank, keep)


def freeze(model: nn.Module, *, force: bool = False) -> nn.Module:
    """An inference copy of ``model`` with its static gates fixed and unused experts removed.

    Every static gate is replaced by a :class:`FixedGate` holding its (eval-mode) weights. When
    all gates are static, the experts no gate uses are removed from the expert bank (sliced out
    of a :class:`~dselectk.layers.StackedMLP` or :class:`~dselectk.layers.ExpertList`; other
    banks are wrapped in :class:`SelectedExperts`) and the mixer no longer checks which experts
    are used (``conditional=False``; all kept experts are). Per-example gates are kept as they
    are and keep routing each example, exactly; all experts stay then, since they may use any.

    The predictions equal ``model``'s in eval mode (the same experts, the same weights). The
    frozen gates' auxiliary loss is 0 and the gate weights the model returns cover the kept
    experts only. The frozen model's selection is part of its structure, so it exports as a
    static gather (:func:`to_onnx`, :func:`export_program`). ``model`` is not modified.

    A static gate must have converged, as its :meth:`~dselectk.gates.base.Gate.freeze_blocker`
    says: DSelect-k once S(Z) is binary (at most k experts); Top-k and Gumbel-softmax always
    (their eval-mode weights are a hard selection); other gates with k selectors (the
    softmax-selector ablations, COMET) when at most k weights are nonzero; dense gates (softmax)
    never.

    Args:
        model: a :class:`~dselectk.models.MoE` or :class:`~dselectk.models.MultiGateMoE`.
        force: freeze gates that have not converged too (the outputs are still unchanged; only
            the experts whose weight is exactly zero are removed).

    Raises:
        ValueError: a static gate has not converged and ``force`` is False.

    Examples:
        >>> import torch
        >>> from dselectk import DSelectK, MultiGateMoE
        >>> from dselectk.export import freeze
        >>> from dselectk.layers import StackedMLP
        >>> gates = DSelectK(num_experts=8, k=2, num_gates=2)
        >>> towers = StackedMLP(2, 32, [1], final_activation=False)
        >>> model = MultiGateMoE(StackedMLP(8, 16, [32]), gates, towers).eval()
        >>> gates.set_selection(torch.tensor([[0, 3], [3, 5]]))  # as training leaves it
        >>> frozen = freeze(model)  # experts 0, 3, 5 kept; the gates fixed
        >>> frozen.mixer.num_experts, type(frozen.gates).__name__
        (3, 'FixedGate')
        >>> x = torch.randn(4, 16)  # (B, 16) -> 2 tasks' (B, 1)
        >>> all(torch.allclose(a, b) for a, b in zip(frozen(x).outputs, model(x).outputs))
        True
    """
    check_flag("force", force)
    if not isinstance(model, MoE | MultiGateMoE):
        raise TypeError(f"freeze takes a MoE or MultiGateMoE, got {type(model).__name__}")
    frozen = copy.deepcopy(model).eval()
    if isinstance(frozen, MoE):
        slots: list[tuple[nn.Module, str, Gate]] = [(frozen, "gate", frozen.gate)]
    elif isinstance(frozen.gates, Gate):
        slots = [(frozen, "gates", frozen.gates)]
    else:
        assert isinstance(frozen.gates, nn.ModuleList)
        slots = []
        for i, g in enumerate(frozen.gates):
            assert isinstance(g, Gate)
            slots.append((frozen.gates, str(i), g))
    fixed: list[tuple[nn.Module, str, Tensor, bool]] = []
    with torch.no_grad():
        for parent, name, gate in slots:
            if not gate.static:
                continue
            w = gate(None).weights.detach()
            reason = gate.freeze_blocker(w)
            if reason is not None and not force:
                raise ValueError(
                    f"cannot freeze gate {name!r} ({type(gate).__name__}): {reason}; train "
                    "until it converges, or pass force=True to freeze its current weights"
                )
            fixed.append((parent, name, w, gate.num_gates is not None))
    mixer = frozen.mixer
    n = mixer.num_experts
    keep = torch.arange(n)
    all_static = len(fixed) == len(slots)
    if fixed and all_static:
        used = torch.stack([(w != 0).reshape(-1, n).any(0).cpu() for _, _, w, _ in fixed])
        keep = used.any(0).nonzero().flatten()
        if keep.numel() == 0:
            raise ValueError("the static gates give every expert a zero weight")
    for parent, name, w, bank in fixed:
        setattr(parent, name, FixedGate(w[..., keep.to(w.device)], bank=bank))
    if fixed:
        experts = mixer.experts if keep.numel() == n else _select_experts(mixer.experts, keep)
        frozen.mixer = type(mixer)(experts, mixer.conditional and not all_static)
    return frozen.eval()
