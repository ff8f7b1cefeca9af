"""Device-agnostic: the same numbers on an accelerator as on the CPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

import dselectk as dk
from dselectk._testing import assert_same_step as _assert_same_step
from dselectk._testing import cuda_pair as _pair
from dselectk._testing import grads as _grads
from dselectk.gates import gate_names
from dselectk.layers import StackedMLP
from dselectk.models import MultiGateMoE

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", gate_names())
def test_gate_on_cuda_matches_cpu(name: str) -> None:
    kw = {} if name in ("softmax", "gumbel_softmax") else {"k": 2}
    torch.manual_seed(0)
    gate = dk.make_gate(name, 8, in_features=5, num_gates=2, **kw).double().eval()
    x = torch.randn(7, 5, dtype=torch.float64)
    cpu = gate(x)
    gpu = gate.to("cuda")(x.to("cuda"))
    torch.testing.assert_close(gpu.weights.cpu(), cpu.weights)
    torch.testing.assert_close(gpu.aux_loss.cpu(), cpu.aux_loss)


@pytest.mark.gpu
@cuda
def test_mmoe_step_on_cuda() -> None:
    model = MultiGateMoE(
        StackedMLP(8, 6, [16], final_activation=True),
        dk.DSelectK(8, 2, num_gates=2),
        StackedMLP(2, 16, [1], final_activation=True),
    ).to("cuda")
    out = model(torch.randn(4, 6, device="cuda"))
    (sum(o.sum() for o in out.outputs) + out.aux_loss).backward()
    assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())


# --- issue 25: the gate, the MoE layer and the training step on a GPU, each against the CPU ---


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", gate_names())
@pytest.mark.parametrize("batch", [1, 16, 300])
def test_gate_gradients_on_cuda_match_cpu(name: str, batch: int) -> None:
    """Forward and backward of every per-example gate, at small and large batch sizes (the CPU
    side takes the fast kernels where they apply; CUDA the torch path)."""
    kw = {} if name in ("softmax", "gumbel_softmax") else {"k": 3}
    torch.manual_seed(1)
    cpu, gpu = _pair(dk.make_gate(name, 16, in_features=12, **kw).train())
    x = torch.randn(batch, 12, dtype=torch.float64)
    outs = []
    for gate, xx in ((cpu, x), (gpu, x.to("cuda"))):
        torch.manual_seed(2)  # a stochastic gate draws the same noise only on one device;
        out = gate(xx)  # compare the deterministic ones, and the rest for finiteness
        (out.weights.square().sum() + out.aux_loss).backward()
        outs.append(out)
    grads_cpu, grads_gpu = _grads(cpu), _grads(gpu)
    assert grads_cpu.keys() == grads_gpu.keys() and grads_cpu
    if name == "gumbel_softmax":
        assert all(torch.isfinite(g).all() for g in grads_gpu.values())
        return
    torch.testing.assert_close(outs[1].weights.cpu(), outs[0].weights)
    for key in grads_cpu:
        torch.testing.assert_close(grads_gpu[key], grads_cpu[key], msg=key)


@pytest.mark.gpu
@cuda
def test_static_gate_bank_on_cuda_matches_cpu() -> None:
    torch.manual_seed(3)
    cpu, gpu = _pair(dk.DSelectK(16, 4, num_gates=64))
    for gate in (cpu, gpu):
        (gate().weights.square().sum() + gate().aux_loss).backward()
    for key, g in _grads(cpu).items():
        torch.testing.assert_close(_grads(gpu)[key], g, msg=key)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    ("router", "routing", "capacity"),
    [
        ("topk", "token", None),
        ("dselect_k", "token", None),
        ("dselect_k", "token", 1.0),
        ("softmax", "expert", 1.0),
    ],
)
def test_sparse_moe_layer_on_cuda_matches_cpu(
    router: str, routing: str, capacity: float | None
) -> None:
    from dselectk.layers import SparseMoEFeedForward

    torch.manual_seed(4)
    layer = SparseMoEFeedForward(
        16, 24, 8, router, k=2, selectors=None, renormalize=False, routing=routing,
        capacity_factor=capacity,
    )  # fmt: skip
    cpu, gpu = _pair(layer)
    x = torch.randn(3, 40, 16, dtype=torch.float64)
    outs = []
    for mod, xx in ((cpu, x), (gpu, x.to("cuda"))):
        out, aux = mod(xx)
        (out.square().sum() + aux).backward()
        outs.append(out)
    torch.testing.assert_close(outs[1].cpu(), outs[0])
    for key, g in _grads(cpu).items():
        torch.testing.assert_close(_grads(gpu)[key], g, msg=key)


@pytest.mark.gpu
@cuda
def test_training_loop_on_cuda_matches_cpu() -> None:
    """Two epochs of the one training loop, a per-example DSelect-k MMoE, data on the device."""
    from dselectk.training import TaskData, TrainConfig, train

    losses = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(5)
        model = (
            MultiGateMoE(
                StackedMLP(4, 6, [8], final_activation=True),
                dk.DSelectK(4, 2, in_features=6, num_gates=2),
                StackedMLP(2, 8, [1], final_activation=True),
            )
            .double()
            .to(device)
        )
        g = torch.Generator().manual_seed(6)
        x = torch.randn(64, 6, generator=g, dtype=torch.float64)
        ys = [torch.randn(64, 1, generator=g, dtype=torch.float64) for _ in range(2)]
        data = TaskData(x.to(device), [y.to(device) for y in ys])
        hist = train(model, data, "mse", TrainConfig(epochs=2, batch_size=16, lr=0.01))
        losses.append(hist.train_loss)
    assert len(losses[0]) == 2
    assert losses[1] == pytest.approx(losses[0], rel=1e-9)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("fused", [True, False])
def test_c1_bank_loss_on_cuda_matches_cpu(fused: bool) -> None:
    """The C.1 model (R members, static gates) and its fused loss node, on both devices."""
    from dselectk.models.bank import MoEBank

    torch.manual_seed(7)
    experts = StackedMLP(3 * 8, 10, [1], final_activation=True)
    bank = MoEBank(experts, dk.DSelectK(8, 4, num_gates=3 * 2), members=3)
    assert bank.fusable
    cpu, gpu = _pair(bank)
    x, y = torch.randn(32, 10, dtype=torch.float64), torch.randn(32, 2, dtype=torch.float64)
    _assert_same_step(cpu, gpu, lambda mod, dev: mod.loss(x.to(dev), y.to(dev), fused=fused))


@pytest.mark.gpu
@cuda
def test_mixtral_with_our_router_on_cuda_matches_cpu() -> None:
    transformers = pytest.importorskip("transformers")
    from dselectk.integrations.hf import replace_routers

    torch.manual_seed(9)
    cfg = transformers.MixtralConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    model = transformers.MixtralForCausalLM(cfg)
    replace_routers(model, "dselect_k")
    import copy

    cpu, gpu = model, copy.deepcopy(model).to("cuda")  # float32: HF's grouped_mm has no float64
    ids = torch.randint(0, 50, (2, 9))
    _assert_same_step(
        cpu,
        gpu,
        lambda mod, dev: mod(input_ids=ids.to(dev), labels=ids.to(dev)).loss,
        rel=1e-5,
        rtol=1e-3,
        atol=1e-5,
    )


@pytest.mark.gpu
@cuda
def test_export_on_cuda_matches_eager() -> None:
    """torch.export of a per-example DSelect-k MMoE on the GPU, verified against eager there."""
    from dselectk.export import export_program

    torch.manual_seed(10)
    model = MultiGateMoE(
        StackedMLP(4, 6, [8], final_activation=True),
        dk.DSelectK(4, 2, in_features=6, num_gates=2),
        StackedMLP(2, 8, [1], final_activation=True),
    ).to("cuda")
    program = export_program(model, (torch.randn(5, 6, device="cuda"),))
    x = torch.randn(9, 6, device="cuda")
    eager = model.eval()(x).outputs
    exported = program.module()(x)
    for a, b in zip(exported, eager):
        torch.testing.assert_close(a, b)


def test_kernel_dispatch_by_device_and_size() -> None:
    """CUDA takes the small kernel up to its own bound (fewer launches); the CPU's rule is as
    before: small, composed, then fused by size."""
    from dselectk.kernels import dispatch
    from dselectk.kernels.aten import _DSelectFused, _DSelectSmall

    cuda_dev, cpu_dev = torch.device("cuda"), torch.device("cpu")
    assert dispatch._kernel_for(dispatch.CUDA_SMALL_MAX_ELEMENTS, cuda_dev) is _DSelectSmall
    assert (
        dispatch._kernel_for(10**9, cuda_dev, triton_ok=True) is dispatch.triton_cuda.DSelectTriton
    )
    assert dispatch._kernel_for(dispatch.CUDA_SMALL_MAX_ELEMENTS + 1, cuda_dev) is _DSelectFused
    assert dispatch._kernel_for(dispatch.SMALL_MAX_ELEMENTS, cpu_dev) is _DSelectSmall
    assert dispatch._kernel_for(dispatch.FUSED_MIN_ELEMENTS, cpu_dev) is _DSelectFused
    assert dispatch._kernel_for(dispatch.CUDA_SMALL_MAX_ELEMENTS, cpu_dev) is _DSelectFused


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("batch", [256, 4096])
@pytest.mark.parametrize("use_triton", [True, False])
def test_cuda_small_kernel_matches_composed_formulas(
    batch: int, use_triton: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-example gate's CUDA paths (the Triton kernels; without them, the small kernel at
    these sizes) against the composed autograd formulas, values and gradients, float64."""
    from dselectk.kernels import dispatch

    if not use_triton:
        monkeypatch.setenv("DSELECTK_TRITON", "0")
    elif not dispatch.triton_cuda.available(
        torch.zeros(1, 1, 1, device="cuda", dtype=torch.float64)
    ):
        pytest.skip("Triton does not import here")
    torch.manual_seed(11)
    alpha = torch.randn(batch, 4, dtype=torch.float64, device="cuda", requires_grad=True)
    z = torch.randn(batch, 4, 7, dtype=torch.float64, device="cuda", requires_grad=True)
    g_w = torch.randn(batch, 128, dtype=torch.float64, device="cuda")
    g_e = torch.randn(batch, 4, dtype=torch.float64, device="cuda")
    results = []
    for composed in (False, True):
        if composed:  # no kernel at any size
            monkeypatch.setattr(dispatch, "CUDA_SMALL_MAX_ELEMENTS", 0)
            monkeypatch.setattr(dispatch, "SMALL_MAX_ELEMENTS", 0)
            monkeypatch.setattr(dispatch, "FUSED_MIN_ELEMENTS", 2**62)
        w, ent = dispatch.dselect_k_fused(alpha, z, 0.7)
        grads = torch.autograd.grad([w, ent], [alpha, z], [g_w, g_e])
        results.append((w, ent, *grads))
    for fast, reference in zip(*results):
        torch.testing.assert_close(fast, reference)


_SYNCS = ("item", "__bool__", "__float__", "__int__", "tolist")


@pytest.mark.parametrize("num_experts", [128, 6])  # 6: the unused-code penalty's path too
@pytest.mark.parametrize("static", [False, True])
def test_dselect_k_step_reads_nothing_back(
    num_experts: int, static: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DSelect-k step on the ATen path (the one a GPU takes) reads no tensor back to the host:
    on a GPU each read is a device sync that stalls the pipeline (γ was checked every call)."""
    from torch.overrides import TorchFunctionMode

    monkeypatch.setenv("DSELECTK_KERNEL", "aten")
    reads: list[str] = []

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if getattr(func, "__name__", "") in _SYNCS:
                reads.append(func.__name__)
            return func(*args, **(kwargs or {}))

    kw = {"num_gates": 3} if static else {"in_features": 8}
    gate = dk.DSelectK(num_experts, 2, entropy_reg=0.1, **kw)
    x = None if static else torch.randn(16, 8)
    with Reads():
        out = gate(x)
        (out.weights.square().sum() + out.aux_loss).backward()
    assert reads == []


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("static", [False, True])
def test_dselect_k_step_on_cuda_never_syncs(static: bool) -> None:
    kw = {"num_gates": 3} if static else {"in_features": 8}
    gate = dk.DSelectK(128, 4, entropy_reg=0.1, **kw).to("cuda")
    x = None if static else torch.randn(300, 8, device="cuda")
    gate(x)  # first call: allocator and caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = gate(x)
        (out.weights.square().sum() + out.aux_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("g", "k", "m"), [(7, 2, 1), (300, 4, 7), (33, 3, 7), (5, 5, 4)])
@pytest.mark.parametrize("per_gate", [False, True])
def test_triton_kernels_on_cuda_match_the_aten_small_kernel(
    dtype: torch.dtype, g: int, k: int, m: int, per_gate: bool
) -> None:
    """dselectk.kernels.triton_cuda compiled on the GPU against the ATen small kernel on the
    same GPU: values and both gradients, saturated bits included, up to TRITON_MAX_BITS = 7
    bits."""
    pytest.importorskip("triton")
    from _triton_check import assert_triton_matches_small_kernel

    gen = torch.Generator(device="cuda").manual_seed(g + k + m)
    z = torch.randn(g, k, m, generator=gen, device="cuda", dtype=dtype) * 0.8
    z[0, 0, 0], z[-1, -1, -1] = 5.0, -3.0
    alpha = torch.randn(g, k, generator=gen, device="cuda", dtype=dtype)
    gamma = (
        torch.rand(g, generator=gen, device="cuda", dtype=dtype) + 0.5
        if per_gate
        else torch.tensor(0.7, device="cuda", dtype=dtype)
    )
    assert_triton_matches_small_kernel(z, alpha, gamma)


@pytest.mark.gpu
@cuda
def test_cuda_gate_takes_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from dselectk.kernels import triton_cuda as _triton

    pytest.importorskip("triton")
    calls = []
    original = _triton.DSelectTriton.apply

    def spy(*args: torch.Tensor) -> object:
        calls.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(_triton.DSelectTriton, "apply", spy)
    gate = dk.DSelectK(128, 4, in_features=8).to("cuda")
    for batch in (1, 4096):
        out = gate(torch.randn(batch, 8, device="cuda"))
        (out.weights.sum() + out.aux_loss).backward()
    assert [tuple(c) for c in calls] == [(1, 4, 7), (4096, 4, 7)]
