"""A plain, reusable multi-task training loop, split by responsibility:

* :mod:`~dselectk.training.loop`: :func:`train`, the loop itself;
* :mod:`~dselectk.training.config`: :class:`TrainConfig`, :func:`seed_everything` (the optimizer
  a config names is built by :func:`~dselectk.optim.make_optimizer`, re-exported here);
* :mod:`~dselectk.training.tasks`: :class:`TaskData`, the named losses (:data:`LOSSES`), how each
  model family's output becomes per-task predictions, :func:`evaluate`;
* :mod:`~dselectk.training.guards`: the data checks and the divergence guard
  (:class:`TrainingDivergedError`, :func:`loss_diverged`);
* :mod:`~dselectk.training.checkpoint`: what a checkpoint holds and the checks on resuming it;
* :mod:`~dselectk.training.callbacks`: :class:`Callback` and the callbacks that observe the
  gates on a probe batch, :class:`GateObserver` (:class:`GateRecorder`, and
  :class:`~dselectk.telemetry.RoutingTelemetry`);
* :mod:`~dselectk.training.state`: :class:`History` and the run's mutable state.

Per-task losses are combined as a weighted **sum** Σ_t w_t ℓ_t, as in the reference Keras setup
(Keras sums the losses of a multi-output model). A mean over tasks would silently scale every
gate's regulariser λ by T relative to the data loss; with the sum, λ means the same thing
whatever the number of tasks. Auxiliary losses returned by the model (entropy terms, penalties,
balancing) are added unscaled.

The loop is the package's only one: the experiments drive it with their own batch loss
(``loss_fn``), their own optimizer (e.g. :class:`~dselectk.optim.RowwiseAdam` for vectorized
models) and callbacks that see every batch (``on_step``) and every epoch (``on_epoch``).

Distributed data parallel: wrap the model in ``torch.nn.parallel.DistributedDataParallel`` and
call :func:`train` in every process (e.g. under ``torchrun``). When a process group is
initialised, every epoch's shuffled order is the same on all ranks and each rank trains on its own
equal-sized shard, so ``batch_size`` is per process and DDP averages the gradients of a global
batch of ``world_size * batch_size``. Only rank 0 shows a progress bar.

Nothing goes silently wrong: a diverged step (a non-finite loss, gradient or parameter, or a loss
more than ``TrainConfig.divergence_factor`` times its start) stops training with a
:class:`TrainingDivergedError` naming the step, the epoch, the task and the cause (or is skipped
or trained through and counted, see ``TrainConfig.nonfinite``); the targets of the named losses
are checked at the first step; validation data is checked before training; a checkpoint carries
its run's configuration, and resuming it with another one is a :class:`CheckpointMismatchError`
(see ``TrainConfig.checkpoint``), resuming one with NaN/inf weights a :class:`CheckpointError`.
"""

from dselectk.optim import make_optimizer
from dselectk.training.callbacks import Callback, GateObserver, GateRecorder
from dselectk.training.checkpoint import CheckpointError, CheckpointMismatchError, data_digest
from dselectk.training.config import BatchLossFn, TrainConfig, seed_everything
from dselectk.training.guards import DIVERGENCE_FACTOR, TrainingDivergedError, loss_diverged
from dselectk.training.loop import train
from dselectk.training.state import History
from dselectk.training.tasks import LOSSES, LossFn, TaskData, evaluate

__all__ = [
    "DIVERGENCE_FACTOR",
    "LOSSES",
    "BatchLossFn",
    "Callback",
    "CheckpointError",
    "CheckpointMismatchError",
    "GateObserver",
    "GateRecorder",
    "History",
    "LossFn",
    "TaskData",
    "TrainConfig",
    "TrainingDivergedError",
    "data_digest",
    "evaluate",
    "loss_diverged",
    "make_optimizer",
    "seed_everything",
    "train",
]
