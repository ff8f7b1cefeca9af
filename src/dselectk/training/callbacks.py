"""The hooks of :func:`~dselectk.training.train`: :class:`Callback` (after every step, every
epoch, at the end), and the one family of callbacks that observe the gates,
:class:`GateObserver`: every ``every`` optimizer steps it runs the model on a fixed ``probe``
batch in eval mode and measures its gates. Two members: :class:`GateRecorder` records the gate
weights into the :class:`~dselectk.training.History` (kept by checkpoints), and
:class:`~dselectk.telemetry.RoutingTelemetry` writes per-gate routing statistics to TensorBoard,
JSON lines or memory. Both take the same ``every``, ``probe``, ``probe_size``, ``forward`` and
``module`` arguments."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from dselectk.gates.base import Gate, check_positive_int
from dselectk.training.state import History

if TYPE_CHECKING:
    from dselectk.training.tasks import TaskData

__all__ = ["Callback", "GateObserver", "GateRecorder"]


class Callback:
    """Hooks of :func:`train`; override what you need (all default to doing nothing).

    A plain callable ``f(model, history)`` passed as a callback is called after every step,
    like :meth:`on_step` (the batch and output are not passed to it).

    Examples:
        >>> from dselectk.gates import SoftmaxGate
        >>> from dselectk.layers import StackedMLP
        >>> from dselectk.models import MoE
        >>> from dselectk.training import TaskData, TrainConfig, train
        >>> class LossPrinter(Callback):
        ...     def on_epoch(self, model, epoch, history):
        ...         print(epoch, len(history.train_loss))
        >>> model = MoE(StackedMLP(4, 3, [1], final_activation=False), SoftmaxGate(4))
        >>> x = torch.randn(32, 3)
        >>> _ = train(model, TaskData(x, [x[:, :1]]), "mse",
        ...           TrainConfig(epochs=2, progress=False), callbacks=[LossPrinter()])
        1 1
        2 2
    """

    def on_step(self, model: nn.Module, batch: TaskData, out: Any, history: History) -> None:
        """After every optimizer step and scheduler step: the batch and the model's output
        (``None`` when ``loss_fn`` returned none)."""

    def on_epoch(self, model: nn.Module, epoch: int, history: History) -> None:
        """After every epoch (1-based ``epoch``), after validation, before the checkpoint."""

    def on_train_end(self, model: nn.Module, history: History) -> None:
        """Once when training ends, normally or by an exception (release files, writers)."""


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP/DataParallel and torch.compile wrappers (hooks must see it)."""
    for _ in range(4):
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(
            model, (nn.parallel.DistributedDataParallel, nn.DataParallel)
        ):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


class GateObserver(Callback):
    """Base of the callbacks that observe the gates every ``every`` optimizer steps.

    On a step whose count is a multiple of ``every`` (``history.steps % every == 0``; nothing at
    all is done on the other steps) it calls :meth:`observe`. Observers that run the model do so
    on a fixed *probe* batch, in eval mode (deterministic routing: no Gumbel noise, no dropout,
    no batch-norm updates, no draws from the RNG: observing never changes the run; the modules'
    modes are restored after) and without gradients.

    Args:
        every: observe after every ``every``-th optimizer step.
        probe: fixed inputs of the model, a tensor or whatever ``forward`` takes (default: the
            first ``probe_size`` rows of ``batch.x`` at the first observed step, then kept so
            that observations are comparable).
        probe_size: rows of the default probe.
        forward: ``forward(model, probe)`` runs the model on the probe (default
            ``model(probe)``).
        module: observe this module instead of the model the training loop passes (e.g. the
            model inside a wrapper that ``train`` drives); DDP, DataParallel and
            ``torch.compile`` wrappers are looked through either way.

    Examples:
        >>> from dselectk.gates import SoftmaxGate
        >>> from dselectk.layers import StackedMLP
        >>> from dselectk.models import MoE
        >>> from dselectk.training import History, TaskData
        >>> class PrintWeights(GateObserver):  # per-example gate: (probe rows, experts)
        ...     def observe(self, model, history, batch):
        ...         w = self.run_probe(self.target(model), self.probe_for(batch)).weights
        ...         print(history.steps, tuple(w.shape))
        >>> experts = StackedMLP(4, 3, [1], final_activation=False)
        >>> model = MoE(experts, SoftmaxGate(4, in_features=3))
        >>> obs, hist = PrintWeights(every=2, probe_size=8), History(steps=2)
        >>> obs.on_step(model, TaskData(torch.randn(16, 3), [torch.zeros(16, 1)]), None, hist)
        2 (8, 4)
    """

    def __init__(
        self,
        every: int = 100,
        *,
        probe: Tensor | None = None,
        probe_size: int = 128,
        forward: Callable[[nn.Module, Any], Any] | None = None,
        module: nn.Module | None = None,
    ) -> None:
        self.every = check_positive_int("every", every)
        self.probe_size = check_positive_int("probe_size", probe_size)
        if forward is not None and not callable(forward):
            raise TypeError(f"forward must be callable, got {type(forward).__name__}")
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.probe = probe
        self.forward = forward
        self.module = module

    def on_step(self, model: nn.Module, batch: Any, out: Any, history: History) -> None:
        """Call :meth:`observe` when ``history.steps`` is a multiple of ``every``."""
        if history.steps % self.every:
            return
        self.observe(model, history, batch)

    def observe(self, model: nn.Module, history: History, batch: Any) -> None:
        """Observe the gates now (override)."""
        raise NotImplementedError

    def target(self, model: nn.Module) -> nn.Module:
        """The module observed: ``module`` if given, else ``model``, unwrapped."""
        return unwrap(model if self.module is None else self.module)

    def probe_for(self, batch: Any) -> Any:
        """The probe: ``probe``, else the first ``probe_size`` rows of ``batch.x`` (kept)."""
        if self.probe is None:
            x = getattr(batch, "x", batch)
            if not isinstance(x, Tensor):
                raise ValueError(
                    f"{type(self).__name__} needs a probe: pass probe= (model inputs) or "
                    "observe a step whose batch has a tensor .x"
                )
            self.probe = x[: self.probe_size].detach().clone()
        return self.probe

    def run_probe(self, module: nn.Module, probe: Any) -> Any:
        """The output of ``module`` on ``probe``, in eval mode and without gradients (the
        modules' training modes restored after)."""
        modes = [(m, m.training) for m in module.modules()]
        try:
            module.eval()
            with torch.no_grad():
                if self.forward is not None:
                    return self.forward(module, probe)
                return module(probe)
        finally:
            for m, mode in modes:
                m.training = mode


class GateRecorder(GateObserver):
    """Records the gate weights on the probe every ``every`` steps into
    :attr:`History.recorded_steps` and :attr:`History.recorded_weights` (kept by checkpoints):
    the ``gate_weights`` (else ``weights``) of the model's output, per-example weights averaged
    over the probe. The arguments are :class:`GateObserver`'s.

    Examples:
        >>> from dselectk.gates import DSelectK
        >>> from dselectk.layers import StackedMLP
        >>> from dselectk.models import MultiGateMoE
        >>> from dselectk.training import TaskData, TrainConfig, train
        >>> model = MultiGateMoE(StackedMLP(4, 3, [8]), DSelectK(4, 2, num_gates=2),
        ...                      StackedMLP(2, 8, [1], final_activation=False))
        >>> x = torch.randn(64, 3)
        >>> hist = train(model, TaskData(x, [x[:, :1], x[:, 1:2]]), "mse",
        ...              TrainConfig(epochs=2, batch_size=16, progress=False, search=None),
        ...              callbacks=[GateRecorder(every=4, probe=x[:32])])
        >>> hist.recorded_steps, tuple(hist.recorded_weights[0].shape)  # (tasks, experts)
        ([4, 8], (2, 4))
    """

    def observe(self, model: nn.Module, history: History, batch: Any) -> None:
        """Record the gate weights of the probe at ``history.steps``."""
        module = self.target(model)
        probe = self.probe_for(batch)
        out = self.run_probe(module, probe)
        w = getattr(out, "gate_weights", None)
        if w is None:
            w = getattr(out, "weights", None)
        if w is None:
            return
        w = w.detach()
        static = all(m.static for m in module.modules() if isinstance(m, Gate))
        rows = probe.shape[0] if isinstance(probe, Tensor) else None
        if w.dim() == 3 or (w.dim() == 2 and w.shape[0] == rows and not static):
            w = w.mean(dim=0)  # per-example weights: the mean over the probe
        history.recorded_steps.append(history.steps)
        history.recorded_weights.append(w.cpu().clone())


def step_hooks(callbacks: Sequence[Any]) -> list[Callable[..., None]]:
    hooks: list[Callable[..., None]] = []
    for cb in callbacks:
        if isinstance(cb, Callback):
            hooks.append(cb.on_step)
        elif callable(cb):
            hooks.append(lambda model, batch, out, hist, f=cb: f(model, hist))
        else:
            raise TypeError(f"callbacks must be Callback objects or callables, got {cb!r}")
    return hooks
