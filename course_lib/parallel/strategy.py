"""One interface for every way of training: the trainer calls a Strategy, never a wrapper directly.

The training step itself is written once, in :mod:`course_lib.parallel.step`:
``train_step(strategy, x, y)`` calls ``forward_backward`` (the micro-batch loop with ``no_sync``,
:func:`~course_lib.parallel.step.accumulate`; model parallelism overrides it with its pipeline
schedule), then ``finish_grads`` (blocking: the gradient communication), ``clip_grad_norm_``
(the global norm, also when gradients are sharded), ``step`` (optimizer step, + parameter
all-gather for ZeRO) and ``zero_grad``. ``eval_loss`` is the loss of one batch for evaluation.

``comm_s`` accumulates the wall time spent waiting in collectives (exposed communication); the
trainer reads and resets it each step to report ``comm_ms``. PyTorch's wrappers wait for theirs
inside backward and step, where no one can time them apart: their ``comm_s`` stays 0 (TorchDDP).

Our strategies are thin adapters over wrappers with PyTorch's shapes, usable without a trainer:
``DataParallelBucket`` (an nn.Module, like DistributedDataParallel), ``ShardedOptimizer`` (ZeRO-1/2,
an Optimizer, like ZeroRedundancyOptimizer) and ``FullyShardedDataParallel`` (ZeRO-3, an nn.Module,
like FSDP). Each takes ``group=`` / ``process_group=``: data parallelism over a sub-group (the dp
group beside tensor or pipeline parallelism) works like over the world.

Checkpoints: ``state_dict()`` returns the FULL model and optimizer state, gathered from the shards
for the sharded strategies, in the format of the unsharded optimizer, identical on every rank
(for sharded strategies it is a collective: call it on every rank). One format for all
strategies: a checkpoint written under ZeRO-3 resumes under DDP or FSDP, and the reverse;
``load_state_dict`` takes that full state and keeps this rank's shards. Gathering costs one full
copy of the model states in each rank's memory while saving: fine for the course's models; for
models that do not fit once per rank, per-rank sharded checkpoints (torch.distributed.checkpoint)
are the way, not implemented here.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib import registry
from course_lib.parallel.comms import Comms
from course_lib.parallel.step import Precision, accumulate, no_phase

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]



class Strategy:
    """Base class: one process, no communication. Subclasses override what they change."""

    name = "single"

    def __init__(self, model: nn.Module, make_optimizer: OptimizerFactory, group=None):
        self.group = group
        self.dp_rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.dp_world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.module = model  # the plain model: checkpoints and sampling use this
        self.model = model  # what forward is called on (a wrapper for some strategies)
        self.optimizer = make_optimizer(model)
        self.comm_s = 0.0

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, precision: Precision,
                         phase=no_phase) -> torch.Tensor:
        """Forward and backward of the micro-batches x[i], y[i] (accum, B, T); the step's mean loss."""
        return accumulate(self, x, y, precision, phase)

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one batch (B, T), for evaluation (call under torch.no_grad)."""
        return self.model(x, y)[1]

    def figures(self) -> dict:
        """Per-step figures beyond time and loss (model parallelism: bytes per group, bubble)."""
        return {}

    def comm_bytes(self) -> float:
        """Bytes this rank's collectives moved so far; nan where we cannot count them (PyTorch's)."""
        return math.nan

    def no_sync(self):
        return contextlib.nullcontext()

    def compute_parameters(self) -> list[nn.Parameter]:
        """The tensors forward and backward compute with, whose ``.grad`` backward accumulates:
        the module's parameters (ZeRO-3 overrides it: between uses its module shows the shards)."""
        return list(self.module.parameters())

    def stepped_tensors(self) -> dict[nn.Parameter, nn.Parameter]:
        """Compute parameter -> the tensor the optimizer steps in its place, whose ``.grad`` holds its
        gradient after :meth:`finish_grads` (ZeRO-1/2: its fp32 shard; ZeRO-3: its fp32 master).
        Empty where the optimizer steps the parameters themselves."""
        return {}

    def state_order(self) -> list[nn.Parameter]:
        """The module's parameters in the order of the optimizer state's indices (``state_dict()``'s)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def finish_grads(self) -> None:
        pass

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        """Full (unsharded) model and optimizer state; identical on every rank."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class CommsStrategy(Strategy):
    """Base of our own multi-rank strategies: every collective goes through ``self.comms``
    (a :class:`Comms`), which counts its bytes and seconds; ``comm_s`` reads and resets those."""

    def __init__(self, model: nn.Module, make_optimizer: OptimizerFactory, group=None):
        self.comms = Comms(group)  # before Strategy.__init__, whose `comm_s = 0` lands here
        super().__init__(model, make_optimizer, group)

    @property
    def comm_s(self) -> float:
        return self.comms.seconds

    @comm_s.setter
    def comm_s(self, value: float) -> None:
        self.comms.seconds = value

    def comm_bytes(self) -> float:
        return self.comms.volume_bytes


class SingleProcess(Strategy):
    name = "single"


class TorchDDP(Strategy):
    """PyTorch's DistributedDataParallel (bucketed all-reduce overlapped with backward).

    DDP's communication runs inside backward, which waits for it at its end (gloo: the host
    blocks; NCCL: the compute stream waits for the last all-reduce): its exposed communication is
    part of backward's time, and ``comm_s`` stays 0. ``finish_grads`` has nothing left to do (a
    device synchronise there, timed, counted the rest of backward queued on the GPU as
    communication, and stalled the GPU every step).

    Built without ``find_unused_parameters`` (its extra graph walk every step): a model with a
    parameter that gets no gradient stops here with PyTorch's "Expected to have finished reduction
    in the prior iteration" error (torch_zero1 is this wrapper too), where the course's own
    ddp/zero strategies skip it (tests/test_parallel_data.py's corners). The course GPT has none.
    """

    name = "torch_ddp"

    def __init__(self, model, make_optimizer, group=None, bucket_cap_mb: float | None = None,
                 grad_comm_dtype: torch.dtype | None = None):
        super().__init__(model, make_optimizer, group)
        # None: PyTorch's default, 25 MiB buckets and a 1 MiB first one (as our ddp's
        # first_bucket_cap_mb=1.0); any number, even 25, turns the small first bucket off
        device_ids = [model_device(model).index] if model_device(model).type == "cuda" else None
        self.model = nn.parallel.DistributedDataParallel(
            model, device_ids=device_ids, process_group=group, bucket_cap_mb=bucket_cap_mb)
        if grad_comm_dtype is not None and grad_comm_dtype != torch.float32:
            # PyTorch's compression hooks (cast each bucket to 16 bits, all-reduce, cast back);
            # its bf16 hook insists on NCCL, so on gloo the same three steps in compress_hook
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            hook = {torch.bfloat16: default_hooks.bf16_compress_hook,
                    torch.float16: default_hooks.fp16_compress_hook}[grad_comm_dtype]
            state = group
            if model_device(model).type != "cuda":
                hook, state = compress_hook, (group, grad_comm_dtype)
            self.model.register_comm_hook(state, hook)

    def no_sync(self):
        return self.model.no_sync()


def compress_hook(state: tuple, bucket):
    """A DDP communication hook, ``state = (group, dtype)``: the bucket's gradients averaged in
    ``dtype`` (what PyTorch's ``bf16_compress_hook`` / ``fp16_compress_hook`` do, any backend)."""
    group, dtype = state
    group = group if group is not None else dist.group.WORLD
    buffer = bucket.buffer()  # (numel,) flat gradients of this bucket
    wire = buffer.to(dtype).div_(dist.get_world_size(group))
    fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

    def decompress(f):
        buffer.copy_(f.value()[0])
        return buffer
    return fut.then(decompress)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def build_strategy(name: str, model: nn.Module, make_optimizer: OptimizerFactory, **kwargs) -> Strategy:
    """Wrap ``model`` (already on its device, identical on every rank) for strategy ``name``: its
    class is named in the torch-free :data:`course_lib.registry.STRATEGIES` ("module:class") and
    imported here, when built, so that ``course --help`` does not import them all."""
    if name not in registry.STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(registry.STRATEGIES)}")
    if name != "single" and not dist.is_initialized():
        raise RuntimeError(f"strategy {name!r} needs torch.distributed to be initialised (launch with --nproc)")
    module_name, cls_name = registry.STRATEGIES[name].cls.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(model, make_optimizer, **kwargs)
