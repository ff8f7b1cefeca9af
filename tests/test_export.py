"""Export (ONNX, torch.export, tracing) computes what eager computes, on new inputs (issue 13)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import dselectk.layers.mixer as mixer_mod
from dselectk import DSelectK, MoE, MultiGateMoE
from dselectk.export import ExportVerificationError, export_program, to_onnx
from dselectk.gates import DSelectKExtended, gate_names, make_gate
from dselectk.layers import StackedMLP

N, P = 8, 6
BATCHES = (16, 7, 1)
ATOL = 1e-5


def _gate(name: str, per_example: bool, bank: bool, binary: bool) -> Any:
    kw: dict[str, Any] = {}
    if name not in ("softmax", "gumbel_softmax"):
        kw["k"] = 2
    if per_example:
        kw["in_features"] = P
        if name == "topk":
            kw["noisy"] = True  # random in training: exported in eval mode
    if bank:
        kw["num_gates"] = 2
    g = make_gate(name, N, **kw)
    if binary:  # every logit x1e4: S(Z) / S(Wx) binary, selectors and masks hard
        with torch.no_grad():
            for p in g.parameters():
                p.mul_(1e4)
    return g


def _model(name: str, per_example: bool, multi: bool, binary: bool) -> nn.Module:
    torch.manual_seed(0)
    g = _gate(name, per_example, multi, binary)
    experts = StackedMLP(N, P, [5], final_activation=True)
    if multi:
        towers = StackedMLP(2, 5, [4, 1], final_activation=False)
        return MultiGateMoE(experts, g, towers, conditional=True)
    return MoE(experts, g, conditional=True)


def _eager(model: nn.Module, x: Tensor) -> list[Tensor]:
    with torch.no_grad():
        out = model.eval()(x)
    return [out.output] if isinstance(out, tuple) and hasattr(out, "output") else out.outputs


def _onnx_outputs(path: Path, x: Tensor) -> list[Tensor]:
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [torch.from_numpy(o) for o in sess.run(None, {sess.get_inputs()[0].name: x.numpy()})]


def _check_fresh(run: Any, model: nn.Module, seed: int = 123) -> None:
    gen = torch.Generator().manual_seed(seed)
    for b in BATCHES:
        x = torch.randn(b, P, generator=gen)
        for got, want in zip(run(x), _eager(model, x), strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)


CASES = [
    pytest.param(name, per_ex, multi, binary, id=f"{name}-{kind}-{model}-{bits}")
    for name in gate_names()
    for per_ex, kind in ((False, "static"), (True, "per_example"))
    for multi, model in ((False, "moe"), (True, "mtl"))
    for binary, bits in ((True, "binary"), (False, "soft"))
]


@pytest.mark.parametrize(("name", "per_example", "multi", "binary"), CASES)
def test_onnx_equals_eager_on_fresh_inputs(
    tmp_path: Path, name: str, per_example: bool, multi: bool, binary: bool
) -> None:
    pytest.importorskip("onnxruntime")
    model = _model(name, per_example, multi, binary).train()  # to_onnx exports in eval mode
    path = to_onnx(model, torch.randn(16, P), tmp_path / "m.onnx", exporter="torchscript")
    assert model.training  # mode restored
    _check_fresh(lambda x: _onnx_outputs(path, x), model)


@pytest.mark.parametrize(
    ("name", "per_example", "multi", "binary"), [c for c in CASES if "mtl" in c.id]
)
def test_torch_export_equals_eager_on_fresh_inputs(
    name: str, per_example: bool, multi: bool, binary: bool
) -> None:
    model = _model(name, per_example, multi, binary)
    program = export_program(model, torch.randn(16, P))
    runner = program.module()
    _check_fresh(lambda x: list(runner(x)), model)


DYNAMO_FAST = {"dselect_k-per_example-mtl-binary", "dselect_k-static-mtl-binary"}


@pytest.mark.parametrize(
    ("name", "per_example", "multi", "binary"),
    [
        c if c.id in DYNAMO_FAST else pytest.param(*c.values, id=c.id, marks=pytest.mark.slow)
        for c in CASES
    ],
)
def test_dynamo_onnx_equals_eager_on_fresh_inputs(
    tmp_path: Path, name: str, per_example: bool, multi: bool, binary: bool
) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = _model(name, per_example, multi, binary)
    path = to_onnx(model, torch.randn(16, P), tmp_path / "m.onnx", exporter="dynamo", opset=18)
    _check_fresh(lambda x: _onnx_outputs(path, x), model)


def _issue_model() -> MultiGateMoE:
    """The issue's reproduction: per-example DSelect-k with binary S(Wx), conditional=True."""
    torch.manual_seed(0)
    gate = DSelectKExtended(N, 2, in_features=P, num_gates=2, init="spread")
    with torch.no_grad():
        gate.proj.weight.mul_(1e4)
    towers = StackedMLP(2, 5, [4, 1], final_activation=False)
    return MultiGateMoE(
        StackedMLP(N, P, [5], final_activation=True), gate, towers, conditional=True
    ).eval()


class _Outputs(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.model(x).outputs)


def test_issue_plain_torch_onnx_export_is_no_longer_wrong(tmp_path: Path) -> None:
    """torch.onnx.export(dynamo=False) itself (not only to_onnx): a graph valid for new data."""
    pytest.importorskip("onnxruntime")
    model = _issue_model()
    x = torch.randn(16, P)
    assert (model.gate_weights(x)[0] != 0).any(1).sum(1).float().mean() < N  # routing is sparse
    path = tmp_path / "issue.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _Outputs(model),
            (x,),
            str(path),
            dynamo=False,
            input_names=["x"],
            dynamic_axes={"x": {0: "batch"}},
        )
    _check_fresh(lambda x: _onnx_outputs(path, x), model)


def test_old_failure_mode_is_caught_by_verification(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the export-safe path off (the old mixer) the export is wrong: to_onnx raises."""
    pytest.importorskip("onnxruntime")
    model = _issue_model()
    monkeypatch.setattr(mixer_mod, "exporting", lambda: False)
    path = tmp_path / "old.onnx"
    with pytest.raises(ExportVerificationError, match="batch"):
        to_onnx(model, torch.randn(16, P), path, exporter="torchscript")
    assert not path.exists()  # a wrong model is not left behind
    with pytest.raises(RuntimeError, match="data-dependent"):  # torch.export refuses it
        export_program(model, torch.randn(16, P))
    monkeypatch.undo()
    to_onnx(model, torch.randn(16, P), path, exporter="torchscript")
    assert path.exists()


def test_jit_trace_routes_every_input() -> None:
    # Top-k (k=2 of 8) routes through the mixer's dispatch in eager inference
    model = _model("topk", per_example=True, multi=True, binary=True).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(_Outputs(model), (torch.randn(16, P),))
    _check_fresh(lambda x: list(traced(x)), model)


def test_exporting_flag_and_mixer_paths() -> None:
    assert not mixer_mod.exporting()
    model = _issue_model()
    x = torch.randn(16, P)
    w = model.gate_weights(x)[0]
    assert model.mixer.dispatch(x, w) is not None  # eager inference routes


def test_verify_false_keeps_file_and_options(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    model = _model("dselect_k", True, True, True)
    path = to_onnx(
        model,
        torch.randn(1, P),  # batch 1 example: traced at batch 2 for a dynamic batch
        tmp_path / "m.onnx",
        exporter="torchscript",
        verify_export=False,
        output_names=["watch", "rating"],
    )
    _check_fresh(lambda x: _onnx_outputs(path, x), model)
    fixed = to_onnx(
        model, torch.randn(5, P), tmp_path / "f.onnx", exporter="torchscript", dynamic_batch=False
    )
    x = torch.randn(5, P)
    for got, want in zip(_onnx_outputs(fixed, x), _eager(model, x)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    with pytest.raises(ValueError, match="exporter"):
        to_onnx(model, torch.randn(4, P), tmp_path / "x.onnx", exporter="nope")  # type: ignore[arg-type]


def test_integer_inputs_with_an_embedding_bottom(tmp_path: Path) -> None:
    """Fresh inputs for int columns are drawn from the example's values (valid ids)."""
    pytest.importorskip("onnxruntime")

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user, self.item = nn.Embedding(20, 3), nn.Embedding(30, 3)

        def forward(self, x: Tensor) -> Tensor:
            return torch.cat([self.user(x[:, 0]), self.item(x[:, 1])], -1)

    torch.manual_seed(0)
    gate = DSelectK(N, 2, in_features=P, num_gates=2)
    towers = StackedMLP(2, 5, [1], final_activation=False)
    model = MultiGateMoE(StackedMLP(N, P, [5], final_activation=True), gate, towers, bottom=Embed())
    x = torch.stack([torch.randint(0, 20, (32,)), torch.randint(0, 30, (32,))], 1)
    to_onnx(model, x, tmp_path / "ml.onnx", exporter="torchscript")
    export_program(model, x)


def test_missing_onnx_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ImportError, match=r"dselectk\[export\]"):
        to_onnx(_issue_model(), torch.randn(4, P), tmp_path / "m.onnx")
