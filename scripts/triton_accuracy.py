"""Float32 accuracy of DSelect-k's CUDA paths against float64 on the same inputs.

For the shapes of tests/test_device.py's Triton check (and fresh random inputs), this prints
the largest error of the z- and α-gradients and of the outputs, for the Triton kernels and for
the ATen small kernel in float32, each against the float64 ATen kernel (which the float64
Triton check equals). Usage on a GPU machine: ``python scripts/triton_accuracy.py [--out F]``;
the worst case's inputs are saved to F (a torch file) for study on a CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _triton_check import small_kernel as _aten
from _triton_check import triton_kernels as _triton_all


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()
    dev = "cuda"
    worst: dict = {"err": -1.0}
    print(f"{'case':<26}{'path':<8}{'out':>10}{'ent':>10}{'g_z':>10}{'g_a':>10}  g_z scale")
    for g, k, m in [(7, 2, 1), (300, 4, 7), (33, 3, 7), (5, 5, 4)]:
        for per_gate in (False, True):
            for seed in range(args.seeds):
                gen = torch.Generator(device=dev).manual_seed(1000 * seed + g + k + m)
                z = torch.randn(g, k, m, generator=gen, device=dev, dtype=torch.float64) * 0.8
                z[0, 0, 0], z[-1, -1, -1] = 5.0, -3.0
                alpha = torch.randn(g, k, generator=gen, device=dev, dtype=torch.float64)
                gamma = (
                    torch.rand(g, generator=gen, device=dev, dtype=torch.float64) + 0.5
                    if per_gate
                    else torch.tensor(0.7, device=dev, dtype=torch.float64)
                )
                go = torch.randn(g, 2**m, generator=gen, device=dev, dtype=torch.float64)
                ge = torch.randn(g, k, generator=gen, device=dev, dtype=torch.float64)
                inputs64 = (z, alpha, gamma, go, ge)
                inputs32 = tuple(t.float() for t in inputs64)
                # the reference on float32-rounded inputs, in float64
                truth = _aten(*(t.double() for t in inputs32))
                for name, fn in (("aten32", _aten), ("triton32", _triton_all)):
                    got = fn(*inputs32)
                    errs = [(a.double() - b).abs().max().item() for a, b in zip(got, truth)]
                    case = f"{g}x{k}x{m} pg={int(per_gate)} s={seed}"
                    scale = truth[2].abs().max().item()
                    print(
                        f"{case:<26}{name:<8}"
                        + "".join(f"{e:10.2e}" for e in errs)
                        + f"  {scale:.2e}"
                    )
                    if name == "triton32" and errs[2] > worst["err"]:
                        d = (got[2].double() - truth[2]).abs()
                        idx = torch.unravel_index(d.argmax(), d.shape)
                        worst = {
                            "err": errs[2],
                            "case": case,
                            "idx": [int(i) for i in idx],
                            "inputs32": [t.cpu() for t in inputs32],
                            "triton": got[2][idx].item(),
                            "truth": truth[2][idx].item(),
                            "aten32": _aten(*inputs32)[2][idx].item(),
                        }
    print("worst triton32 g_z:", {k: v for k, v in worst.items() if k != "inputs32"})
    if args.out:
        torch.save(worst, args.out)


if __name__ == "__main__":
    main()
