"""Peak memory of one per-example gate's forward + backward, measured in a fresh process.

Run by the ``memory`` item as ``python -m benchmarks.memory_child KIND DEVICE [sizes]`` from the
repository root; prints one JSON line: ``rss_before_mb``, ``rss_peak_mb``, ``rss_growth_mb``
(and ``cuda_peak_mb`` on CUDA). KIND is ``ours`` (DSelectK) or ``naive`` (the product table).
"""

from __future__ import annotations

import argparse
import json
import resource

import torch

from benchmarks.gate import NaiveDSelectK
from dselectk.gates import DSelectK

DEFAULTS = {"batch": 4096, "features": 64, "experts": 1024, "k": 4}


def rss_mb(field: str) -> float:
    """``field`` (VmRSS, VmHWM) of /proc/self/status in MB, else the max RSS from getrusage."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(kind: str, dev: torch.device, batch: int, features: int, experts: int, k: int) -> dict:
    """Peak memory of two forward+backward passes of the ``kind`` gate after setup."""
    torch.manual_seed(0)
    x = torch.randn(batch, features, device=dev)
    gate = DSelectK(experts, k, in_features=features, entropy_reg=0.1).to(dev)
    naive = NaiveDSelectK(gate.proj, k, gate.num_bits, gate.gamma, 0.1)
    g = torch.randn(batch, experts, device=dev)

    def run() -> None:
        if kind == "ours":
            o = gate(x)
            w, aux = o.weights, o.aux_loss
        else:
            w, aux = naive(x)
        torch.autograd.backward([w, aux], [g, torch.ones_like(aux)])

    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    try:  # reset the peak RSS (VmHWM) so that the import and setup peaks do not hide ours
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    before = rss_mb("VmRSS")
    run()
    run()
    peak = rss_mb("VmHWM")
    out = {"rss_before_mb": before, "rss_peak_mb": peak, "rss_growth_mb": peak - before}
    if dev.type == "cuda":
        torch.cuda.synchronize()
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def size_args(batch: int, features: int, experts: int, k: int) -> list[str]:
    """The command-line options that select these sizes."""
    return [f"--batch={batch}", f"--features={features}", f"--experts={experts}", f"--k={k}"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory_child", description=__doc__)
    p.add_argument("kind", choices=("ours", "naive"))
    p.add_argument("device", nargs="?", default="cpu")
    for name, value in DEFAULTS.items():
        p.add_argument(f"--{name}", type=int, default=value)
    a = p.parse_args(argv)
    out = measure(a.kind, torch.device(a.device), a.batch, a.features, a.experts, a.k)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
