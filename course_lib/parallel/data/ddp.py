"""Data parallelism from scratch: every rank holds the whole model and averages gradients.

Two versions behind one interface (``forward``, ``no_sync()``, ``finish_gradient_synchronization()``):

* :class:`DataParallelNaive` waits for the whole backward pass, then all-reduces every gradient,
  one collective per parameter. Easy to read; the network idles during backward and the
  computation idles during communication.
* :class:`DataParallelBucket` groups parameters into buckets of ``bucket_cap_mb`` and launches an
  asynchronous all-reduce for a bucket as soon as the last gradient in it is ready (a
  ``register_post_accumulate_grad_hook`` per parameter), so communication overlaps with the rest
  of backward and there are few, large messages (Li et al. 2020, "PyTorch Distributed", Sec. 3.2).
  Hence one backward per synchronisation, the others under ``no_sync()``: a second one would
  refill buckets already on the wire, so it raises (as PyTorch's DDP does).

Both broadcast rank 0's parameters and buffers at construction, so every rank starts from the
same state whatever its seed. Gradients are averaged (divided by ``dp_world_size``), so each rank
ends with the gradient of the mean loss over the global batch. Tied weights (GPT's wte/lm_head)
are one parameter, counted and communicated once. Frozen parameters (``requires_grad=False``) are
skipped, and so are the experts of expert parallelism (flagged ``ep_sharded``: each rank holds
other experts; :mod:`course_lib.parallel.expert` averages them over their own group); a parameter
that got no gradient on any rank keeps ``grad=None`` (the ranks agree through
one flag per parameter), so the optimizer leaves it alone, as in one process.

``grad_comm_dtype`` (e.g. ``torch.bfloat16``) sends the gradients in 16 bits: each is cast into
a 16-bit buffer before the all-reduce and back to the parameter's dtype after it, so the bytes on
the wire halve (what PyTorch DDP's ``bf16_compress_hook`` does, and Megatron's bf16 gradient
reduction); the sum over ranks is then rounded to 16 bits, a small change in the loss (measured
in tests/test_grad_comm.py).

Wrapping a module again (a notebook cell re-run) replaces the previous wrapper: a parameter carries
one gradient hook of ours, the newest (:func:`register_grad_sync_hook`, also ZeRO-2's). Otherwise
the old wrapper's hooks kept firing in every backward, all-reducing its own buckets as well (twice
the traffic, collectives nobody waits for, its buffers kept alive).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from course_lib.parallel.comms import Comms, broadcast_module, ep_sharded
from course_lib.parallel.data.buckets import bucket_params, common_dtype
from course_lib.parallel.strategy import CommsStrategy


def register_grad_sync_hook(p: nn.Parameter, hook) -> RemovableHandle:
    """``p.register_post_accumulate_grad_hook(hook)``, removing the one a previous wrapper of ours
    (DataParallelBucket, ZeRO-2's ShardedOptimizer) registered on ``p``: a module wrapped again, as a
    re-run notebook cell does, is synchronised by the new wrapper only. The old wrapper's hooks would
    otherwise fire too, launching its own collectives (and ZeRO-2's frees the gradients the new one
    then finds missing). The handle lives on the parameter (a private attribute): the wrappers see
    the same parameter objects, whatever module or optimizer they were given."""
    previous = getattr(p, "_course_grad_sync_hook", None)
    if previous is not None:
        previous.remove()  # a no-op where it was removed already
    p._course_grad_sync_hook = p.register_post_accumulate_grad_hook(hook)
    return p._course_grad_sync_hook


class DataParallelNaive(nn.Module):
    """All-reduce every gradient after backward (no overlap, one message per parameter)."""

    def __init__(self, module: nn.Module, group=None, comms: Comms | None = None,
                 grad_comm_dtype: torch.dtype | None = None):
        super().__init__()
        self.module = module
        self.comms = comms or Comms(group)
        self.dp_world_size = self.comms.world_size
        self.grad_comm_dtype = grad_comm_dtype  # None: communicate in the gradients' dtype
        broadcast_module(module, self.comms)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return contextlib.nullcontext()  # nothing happens until finish_gradient_synchronization

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad and not ep_sharded(p)]
        # Ranks first agree which parameters got a gradient anywhere (one flag each): those that
        # got none keep grad=None, as in one process; the others are averaged (zeros where absent).
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                               device=params[0].device if params else None)
        self.comms.all_reduce(present)
        for p, anywhere in zip(params, present.tolist()):
            if anywhere:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                wire = p.grad.to(self.grad_comm_dtype or p.grad.dtype)  # no copy without a dtype
                # divide before the sum (as the bucketed version and PyTorch's fp16_compress_hook):
                # a 16-bit sum of p undivided gradients overflows fp16 long before their mean does
                self.comms.all_reduce(wire.div_(self.dp_world_size))
                p.grad.copy_(wire)


class Bucket:
    """A flat buffer for the gradients of a few parameters, all-reduced in one message, followed by
    one presence flag per parameter (1 where this rank has a gradient; summed: on how many ranks).
    Its dtype: ``comm_dtype``, else the widest of the parameters' (fp32 beside bf16: fp32)."""

    def __init__(self, params: list[nn.Parameter], comm_dtype: torch.dtype | None = None):
        self.params = params
        numel = sum(p.numel() for p in params)
        self.grad_data = torch.zeros(numel + len(params), dtype=comm_dtype or common_dtype(params),
                                     device=params[0].device)
        self.flags = self.grad_data[numel:]
        self.views, offset = {}, 0
        for p in params:  # each parameter's slice of the buffer, shaped like the parameter
            self.views[p] = self.grad_data[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self.index = {p: i for i, p in enumerate(params)}
        self.ready: set[nn.Parameter] = set()
        self.work = None  # the asynchronous all-reduce, once launched

    def fill(self, p: nn.Parameter, scale: float) -> None:
        """Copy p's gradient (or zeros, flag 0, if it has none) into the buffer, scaled."""
        i = self.index[p]
        if p.grad is None:
            self.views[p].zero_()
        else:
            self.views[p].copy_(p.grad).mul_(scale)
        self.flags[i] = float(p.grad is not None)

    def reset(self) -> None:
        self.ready.clear()
        self.work = None


class DataParallelBucket(nn.Module):
    """Bucketed gradient all-reduce, launched from gradient hooks to overlap with backward."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group=None,
                 comms: Comms | None = None, first_bucket_cap_mb: float | None = 1.0,
                 grad_comm_dtype: torch.dtype | None = None):
        super().__init__()
        self.module = module
        self.comms = comms or Comms(group)
        self.dp_world_size = self.comms.world_size
        broadcast_module(module, self.comms)
        self.require_backward_grad_sync = True
        # frozen ones skipped, and the experts of expert parallelism (ep_sharded: each rank holds other
        # experts; parallel.expert averages them over their own group)
        params = [p for p in module.parameters() if p.requires_grad and not ep_sharded(p)]
        # the first bucket (the last layers) closes at 1 MiB, as in PyTorch's DDP: its all-reduce
        # starts while most of backward is still to run
        self.buckets = [Bucket(b, grad_comm_dtype)
                        for b in bucket_params(params, bucket_cap_mb, first_bucket_cap_mb)]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.next_bucket = 0  # launched in bucket order: every rank issues the same sequence
        self._hooks = [register_grad_sync_hook(p, self._on_grad_ready) for p in params]  # replaces an old wrapper's

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (micro-batches before the last one)."""
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True

    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.require_backward_grad_sync:
            return
        bucket = self.bucket_of[p]
        if bucket.work is not None:
            # a second backward before finish_gradient_synchronization: this bucket's buffer is
            # already being all-reduced, so refilling it would race with the collective (each rank
            # ends with different gradients). PyTorch's DDP refuses this too.
            raise RuntimeError(
                f"DataParallelBucket: a gradient for a parameter of shape {tuple(p.shape)} arrived "
                "after its bucket's all-reduce was launched (a second backward before "
                "finish_gradient_synchronization()); run every backward but the last under no_sync()")
        bucket.fill(p, 1.0 / self.dp_world_size)  # pre-divide: sum -> mean
        bucket.ready.add(p)
        while self.next_bucket < len(self.buckets) and \
                len(self.buckets[self.next_bucket].ready) == len(self.buckets[self.next_bucket].params):
            b = self.buckets[self.next_bucket]
            b.work = self.comms.all_reduce(b.grad_data, async_op=True)
            self.next_bucket += 1

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and write the averaged gradients back."""
        for bucket in self.buckets[self.next_bucket:]:  # with parameters backward did not reach
            for p in bucket.params:                      # (this time): what they accumulated
                if p not in bucket.ready:
                    bucket.fill(p, 1.0 / self.dp_world_size)
            bucket.work = self.comms.all_reduce(bucket.grad_data, async_op=True)
        self.next_bucket = 0
        for bucket in self.buckets:
            self.comms.wait(bucket.work)
            for p, ranks in zip(bucket.params, bucket.flags.tolist()):
                if ranks == 0:  # no gradient on any rank: none here either, as in one process
                    p.grad = None
                elif p.grad is None:
                    p.grad = bucket.views[p].to(p.dtype, copy=True)
                else:
                    p.grad.copy_(bucket.views[p])
            bucket.reset()


class _DataParallelStrategy(CommsStrategy):
    """Strategy adapter: the trainer's interface on top of one of the wrappers above."""

    def no_sync(self):
        return self.model.no_sync()

    def finish_grads(self) -> None:
        self.model.finish_gradient_synchronization()


class DDPNaive(_DataParallelStrategy):
    name = "ddp_naive"

    def __init__(self, model, make_optimizer, group=None, grad_comm_dtype: torch.dtype | None = None):
        super().__init__(model, make_optimizer, group)
        self.model = DataParallelNaive(model, comms=self.comms, grad_comm_dtype=grad_comm_dtype)


class DDP(_DataParallelStrategy):
    """Our bucketed, overlapped data parallelism (the trainer's default)."""

    name = "ddp"

    def __init__(self, model, make_optimizer, group=None, bucket_cap_mb: float = 25,
                 first_bucket_cap_mb: float | None = 1.0, grad_comm_dtype: torch.dtype | None = None):
        super().__init__(model, make_optimizer, group)
        self.model = DataParallelBucket(model, bucket_cap_mb=bucket_cap_mb, comms=self.comms,
                                        first_bucket_cap_mb=first_bucket_cap_mb,
                                        grad_comm_dtype=grad_comm_dtype)
