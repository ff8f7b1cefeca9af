"""Export never silently wrong and never destroys a good file (issue 24, round two)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import dselectk.layers.mixer as mixer_mod
from dselectk import MultiGateMoE
from dselectk.export import (
    VERIFY_BATCH_SIZES,
    ExportVerificationError,
    export_program,
    to_onnx,
    verify,
)
from dselectk.gates import DSelectKExtended
from dselectk.layers import StackedMLP

N, P = 8, 6


def _model(binary: bool = True) -> MultiGateMoE:
    """Per-example DSelect-k, two tasks (binary S(Wx): the mixer's routing matters)."""
    torch.manual_seed(0)
    gate = DSelectKExtended(N, 2, in_features=P, num_gates=2, init="spread")
    if binary:
        with torch.no_grad():
            gate.proj.weight.mul_(1e4)
    towers = StackedMLP(2, 5, [4, 1], final_activation=False)
    return MultiGateMoE(
        StackedMLP(N, P, [5], final_activation=True), gate, towers, conditional=True
    ).eval()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# -- 1. a failed re-export keeps the earlier good file -----------------------------------------
def test_failed_reexport_keeps_the_earlier_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("onnxruntime")
    model = _model()
    path = tmp_path / "m.onnx"
    to_onnx(model, torch.randn(16, P), path, exporter="torchscript")
    good = path.read_bytes()
    assert _leftovers(tmp_path) == []
    monkeypatch.setattr(mixer_mod, "exporting", lambda: False)  # the old, wrong graph
    with pytest.raises(ExportVerificationError, match="already there is kept"):
        to_onnx(model, torch.randn(16, P), path, exporter="torchscript")
    assert path.read_bytes() == good  # not deleted, not overwritten
    assert _leftovers(tmp_path) == []  # the temp file is gone too
    monkeypatch.undo()

    def boom(*a: object, **k: object) -> None:  # the exporter itself failing mid-write
        raise RuntimeError("exporter crashed")

    monkeypatch.setattr(torch.onnx, "export", boom)
    with pytest.raises(RuntimeError, match="crashed"):
        to_onnx(model, torch.randn(16, P), path, exporter="torchscript")
    assert path.read_bytes() == good and _leftovers(tmp_path) == []


def test_export_into_a_new_folder_and_unverified(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    path = tmp_path / "new" / "m.onnx"
    to_onnx(_model(), torch.randn(4, P), path, exporter="torchscript", verify_export=False)
    assert path.stat().st_size > 0 and _leftovers(path.parent) == []


# -- 2. non-finite inputs and outputs ----------------------------------------------------------
def _nan_example() -> Tensor:
    x = torch.randn(16, P)
    x[3, 2] = float("nan")
    return x


def test_non_finite_example_input_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue: one NaN made every fresh input NaN, and NaN "equalled" NaN."""
    pytest.importorskip("onnxruntime")
    model = _model()
    monkeypatch.setattr(mixer_mod, "exporting", lambda: False)  # a wrong graph, hidden by NaN
    path = tmp_path / "m.onnx"
    with pytest.raises(ValueError, match=r"example_inputs\[0\] holds 1 non-finite"):
        to_onnx(model, _nan_example(), path, exporter="torchscript")
    assert not path.exists() and _leftovers(tmp_path) == []
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"example_inputs\[0\]"):
        export_program(model, _nan_example())
    x = torch.randn(16, P)
    x[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"example_inputs\[1\]"):
        verify(lambda xs: [], model, (torch.randn(16, P), x))


def test_verification_rejects_nan_and_unmatched_inf_outputs() -> None:
    model = _model()

    def eager(xs: list[Tensor]) -> list[Tensor]:
        return list(model(*xs).outputs)

    assert verify(eager, model, torch.randn(16, P)) == 0.0

    def nan_in_export(xs: list[Tensor]) -> list[Tensor]:
        out = eager(xs)
        out[1] = out[1].clone()
        out[1][0] = float("nan")
        return out

    with pytest.raises(ExportVerificationError, match="output 1 is not finite"):
        verify(nan_in_export, model, torch.randn(16, P))

    def inf_in_export(xs: list[Tensor]) -> list[Tensor]:
        out = eager(xs)
        out[0] = out[0].clone()
        out[0][-1] = float("inf")
        return out

    with pytest.raises(ExportVerificationError, match="not finite"):
        verify(inf_in_export, model, torch.randn(16, P))


class _Nan(nn.Module):
    """NaN for every input (0 * inf): eager and export agree on NaN, which proves nothing."""

    def forward(self, x: Tensor) -> Tensor:
        return x * float("inf") * 0.0


class _Inf(nn.Module):
    """+inf where x > 0, the same on both sides: allowed (the values match)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.where(x > 0, torch.full_like(x, float("inf")), x)


def test_both_nan_on_finite_inputs_fails_and_equal_inf_passes() -> None:
    nan = _Nan()
    with pytest.raises(ExportVerificationError, match="not finite"):
        verify(lambda xs: [nan(*xs)], nan, torch.randn(16, P))
    with pytest.raises(ExportVerificationError, match="not finite"):
        export_program(nan, torch.randn(16, P))
    inf = _Inf()
    assert verify(lambda xs: [inf(*xs)], inf, torch.randn(16, P)) == 0.0


def test_non_finite_sampled_inputs_are_refused() -> None:
    model = _model()

    def sampler(b: int) -> list[Tensor]:
        x = torch.randn(b, P)
        x[0, 0] = float("nan")
        return [x]

    with pytest.raises(ValueError, match=r"input_sampler\(16\)\[0\]"):
        export_program(model, torch.randn(16, P), input_sampler=sampler)
    with pytest.raises(ValueError, match="overflow"):  # finite example, no finite fresh inputs
        verify(lambda xs: [], model, torch.tensor([[3e38] * P, [-3e38] * P]))


# -- 3. the dynamic batch covers large batches ------------------------------------------------
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "soft"])
def test_exported_per_example_model_takes_large_batches(binary: bool) -> None:
    """The issue: a per-example model's program passed verification, then refused batch 257."""
    assert max(VERIFY_BATCH_SIZES) > 256
    model = _model(binary)
    runner = export_program(model, torch.randn(16, P)).module()
    gen = torch.Generator().manual_seed(1)
    for b in (256, 257, 1024, 4096):
        x = torch.randn(b, P, generator=gen)
        with torch.no_grad():
            want = model(x).outputs
        for got, w in zip(runner(x), want, strict=True):
            torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)


def test_verification_tries_a_large_batch() -> None:
    model = _model()

    def small_only(xs: list[Tensor]) -> list[Tensor]:
        if xs[0].shape[0] > 256:
            raise RuntimeError("Guard failed: 32 * args_0.size()[0] < 8193")
        return list(model(*xs).outputs)

    with pytest.raises(ExportVerificationError, match="batch 1024"):
        verify(small_only, model, torch.randn(16, P))


def test_onnx_of_per_example_model_takes_large_batches(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    model = _model()
    path = to_onnx(model, torch.randn(16, P), tmp_path / "m.onnx", exporter="torchscript")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(2048, P)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = model(x).outputs
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), w, atol=1e-5, rtol=1e-5)


# -- 6. a directory as the path, an empty example batch: clear errors, nothing written ---------
def test_directory_as_path_is_refused_before_any_work(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    folder = tmp_path / "out"
    folder.mkdir()
    with pytest.raises(ValueError, match="is a directory; expected the file to write"):
        to_onnx(_model(), torch.randn(3, P), folder)
    assert list(folder.iterdir()) == [] and _leftovers(tmp_path) == []


def test_empty_example_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="example_inputs have 0 rows"):
        export_program(_model(), torch.randn(0, P))
