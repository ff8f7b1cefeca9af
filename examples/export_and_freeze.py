"""Freeze converged static gates into fixed weights and export the result.

`freeze` replaces every converged static gate by its weights and removes the experts no task
uses (same outputs, fewer parameters); `export_program` (torch.export) and `to_onnx` check the
exported model against eager PyTorch on fresh inputs before returning.

    python examples/export_and_freeze.py            # torch.export
    pip install -e '.[export]'                      # adds the ONNX file as well
"""

import importlib.util
import tempfile
from pathlib import Path

import torch

from dselectk import DSelectK, MultiGateMoE
from dselectk.export import export_program, freeze, to_onnx
from dselectk.layers import StackedMLP

torch.manual_seed(0)
gates = DSelectK(num_experts=8, k=2, num_gates=2, gamma=1.0)
model = MultiGateMoE(
    StackedMLP(8, 16, [32], final_activation=True),
    gates,
    StackedMLP(2, 32, [16, 1], final_activation=False),
)
# Stand-in for a trained model: make each task's selection final (S(Z) binary) on 2 experts,
# as training with the entropy regulariser or the swap search leaves it.
gates.set_selection(torch.tensor([[0, 3], [3, 5]]))  # task 0: experts 0, 3; task 1: 3, 5
assert bool(gates.is_binary().all())

frozen = freeze(model)  # raises a ValueError if a static gate has not converged
count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
print(f"parameters: {count(model):,} -> {count(frozen):,} after freezing")

x = torch.randn(64, 16)
model.eval()
for a, b in zip(model(x).outputs, frozen(x).outputs):
    torch.testing.assert_close(a, b)  # the same predictions

program = export_program(frozen, x)  # torch.export, verified against eager at several batch sizes
print("exported program outputs:", [tuple(o.shape) for o in program.module()(x)])
if importlib.util.find_spec("onnxruntime") and importlib.util.find_spec("onnxscript"):
    with tempfile.TemporaryDirectory() as d:
        path = to_onnx(frozen, x, Path(d) / "frozen.onnx")  # verified with onnxruntime
        print(f"wrote and verified {path.name} ({path.stat().st_size:,} bytes)")
else:
    print("onnxruntime/onnxscript not installed: skipped the ONNX export (the `export` extra)")
