"""ZeRO stages 1 and 2 as an optimizer wrapper (Rajbhandari et al. 2020, "ZeRO", Sec. 5.1-5.2).

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4)   # ZeRO-1
    loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

The shape of PyTorch's ``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class,
process_group=None, **defaults)``, with two differences: ours also does the gradient
communication (ZeroRedundancyOptimizer expects DDP to have all-reduced the gradients), and it
shards every parameter (ZeroRedundancyOptimizer gives whole parameters to ranks).

Plain data parallelism keeps a full copy of the model states on every rank: parameters,
gradients and optimizer states (Adam in fp32: 4 + 4 + 8 bytes per parameter, 16 Psi). With N ranks:

* stage 1 (P_os) shards the optimizer states: after backward the gradients are reduce-scattered
  (each rank receives the averaged 1/N it updates), each rank steps its shards, and the updated
  parameters are all-gathered.  4 + 4 + 8/N bytes per parameter.
* stage 2 (P_os+g, ``shard_gradients=True``) also shards the gradients: a bucket's gradients are
  reduce-scattered as soon as backward produced them and the full ones are freed; at most
  ``max_in_flight`` buckets wait for their reduce-scatter, so no rank holds all gradients.
  4 + (4 + 8)/N.

Communication per rank and step: reduce-scatter (Psi) + all-gather (Psi) = 2 Psi, the volume of
one all-reduce (paper Sec. 7.2.1). Sharding is :mod:`course_lib.parallel.zero.sharding`'s; buckets
follow :mod:`course_lib.parallel.data.buckets`. ``param_groups`` hold this rank's shards, so a learning
rate schedule or a GradScaler acts on what is stepped.

Precision: the shards are fp32 master weights. With 16-bit parameters (``model.to(bfloat16)``)
each shard is an fp32 copy, the step runs in fp32 and the 16-bit parameters are all-gathered.
A bucket mixing dtypes (an fp32 norm beside bf16 weights) is all-gathered in the widest of them,
so each parameter gets its update in its own dtype.
Gradients are reduced in ``reduce_dtype`` (default: fp32, as FSDP2's MixedPrecisionPolicy with
reduce_dtype=float32), pre-divided by N. In fp32 a shard is a view into the parameter (no copy).

Corners, as one process: frozen parameters (requires_grad=False) are skipped, and so are the
experts of expert parallelism (``ep_sharded``: stepped whole, unsharded; :mod:`course_lib.parallel.expert`); a parameter that got
no gradient on any rank keeps ``grad=None`` (flags travel with the gradients, see sharding), so
AdamW leaves it alone; tied weights are one Parameter; under ``no_sync()`` gradients accumulate
locally and are communicated once, after the last micro-batch (both stages; as FSDP's no_sync).
A second ShardedOptimizer over the same parameters (a re-run cell) takes over their gradient hooks.

``state_dict()`` is the FULL state in the unsharded optimizer's format, identical on every rank (a
collective); ``load_state_dict`` takes that format and keeps this rank's shards.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from course_lib.parallel.comms import Comms, broadcast_module, ep_sharded
from course_lib.parallel.data.buckets import bucket_params
from course_lib.parallel.data.ddp import register_grad_sync_hook
from course_lib.parallel.strategy import CommsStrategy
from course_lib.parallel.zero.sharding import (
    ShardLayout,
    clip_sharded_grad_norm_,
    full_optimizer_state,
    load_full_optimizer_state,
    optimizer_kwargs,
    reduce_into,
    regroup_params,
    split_trainable,
)


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2: ``optimizer_class`` over this rank's shards; mirrors ZeroRedundancyOptimizer."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], process_group=None, *,
                 shard_gradients: bool = False, bucket_cap_mb: float = 25,
                 reduce_dtype: torch.dtype = torch.float32, max_in_flight: int | None = 2,
                 comms: Comms | None = None, **defaults):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**g, "params": list(g["params"])} for g in groups]
        self.comms = comms or Comms(process_group)
        self.state_comms = Comms(process_group)  # checkpoint traffic, kept out of the step figures
        self.dp_world_size = self.comms.world_size
        # the experts of expert parallelism (ep_sharded) are not sharded here: each rank steps its
        # own, whole, with the gradients parallel.expert averaged over their group
        self.params, _ = split_trainable(p for g in groups for p in g["params"] if not ep_sharded(p))
        self.stage, self.reduce_dtype, self.max_in_flight = 2 if shard_gradients else 1, reduce_dtype, max_in_flight
        self.layouts = [ShardLayout(b, self.comms.rank, self.dp_world_size)
                        for b in bucket_params(self.params, bucket_cap_mb)]
        self.layout_of: dict[nn.Parameter, tuple[ShardLayout, int]] = {}
        self.shards: dict[nn.Parameter, nn.Parameter] = {}
        for layout in self.layouts:
            for i, p in enumerate(layout.params):
                self.layout_of[p] = (layout, i)
                shard = layout.owned(i, p.detach())  # fp32: a view, the update lands in p itself
                self.shards[p] = nn.Parameter(shard if p.dtype == torch.float32 else shard.float().clone())
        new_of = {p: self.shards.get(p, p) for g in groups for p in g["params"]}  # frozen: as is
        self.optim = optimizer_class(regroup_params(groups, new_of), **defaults)
        super().__init__(self.optim.param_groups, self.optim.defaults)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state  # one copy
        self.full_params = [p for g in groups for p in g["params"]]  # the index order of state
        self.ready = {layout: set() for layout in self.layouts}
        self.next_bucket = 0  # buckets are launched in order, so every rank issues the same sequence
        self.pending: list[tuple] = []  # (layout, work, grad row, packed input kept alive)
        # finished since the last step: what clip and step decide by, the same on every rank (a
        # rank's own gradients are not: one without any would skip the reduce-scatter the rest start)
        self.synchronized = False
        self.sync_grads = True
        # replacing the hooks of a previous ShardedOptimizer (or DataParallelBucket) over these
        # parameters: its hook would free the gradients before ours packs them
        self.hooks = [register_grad_sync_hook(p, self._on_grad_ready)
                      for p in self.params] if shard_gradients else []

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, **kwargs) -> ShardedOptimizer:
        """The same optimizer class, groups and hyper-parameters, sharded."""
        return cls(optimizer.param_groups, type(optimizer), **kwargs, **optimizer_kwargs(optimizer))

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate full gradients locally (micro-batches before the last one)."""
        self.sync_grads = False
        try:
            yield
        finally:
            self.sync_grads = True

    # --- gradients: reduce-scatter bucket by bucket ---------------------------------------------

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync_grads:
            return
        layout, _ = self.layout_of[p]
        self.ready[layout].add(p)
        while self.next_bucket < len(self.layouts) and \
                len(self.ready[self.layouts[self.next_bucket]]) == len(self.layouts[self.next_bucket].params):
            self._launch(self.layouts[self.next_bucket])  # stage 2: overlapped with backward
            self.next_bucket += 1

    @torch.no_grad()
    def _launch(self, layout: ShardLayout) -> None:
        """Average a bucket's gradients, leave each rank its shard; free the full gradients."""
        packed = layout.pack([p.grad for p in layout.params], self.reduce_dtype,
                             scale=1.0 / self.dp_world_size, presence=True)
        for p in layout.params:
            p.grad = None
        row = packed.new_empty(layout.grad_row_numel)
        work = self.comms.reduce_scatter(row, packed.view(-1), async_op=True)
        self.pending.append((layout, work, row, packed))
        self.ready[layout].clear()
        if self.max_in_flight is not None and len(self.pending) > self.max_in_flight:
            self._complete(self.pending.pop(0))  # frees its buffers: peak gradient memory falls

    @torch.no_grad()
    def _complete(self, entry: tuple) -> None:
        layout, work, row, _ = entry
        self.comms.wait(work)
        for i, present in enumerate(layout.present(row)):
            if present:  # no gradient on any rank: no .grad, as in one process
                reduce_into(self.shards[layout.params[i]], layout.in_row(i, row))

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Launch what backward did not (stage 1: everything) and wait for all of it."""
        for layout in self.layouts[self.next_bucket:]:
            self._launch(layout)
        self.next_bucket = 0
        while self.pending:
            self._complete(self.pending.pop(0))
        self.synchronized = True

    def _finish_if_pending(self) -> None:
        """Finish the gradient synchronization unless the caller already did since the last step
        (and no backward added gradients after it)."""
        if not self.synchronized or self.next_bucket or self.pending or any(p.grad is not None for p in self.params):
            self.finish_gradient_synchronization()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the shards' gradients by the whole gradient's norm (returned). Finishes the
        gradient synchronization first, as :meth:`step` does: right after ``backward()`` the
        reduced shard gradients do not exist yet."""
        self._finish_if_pending()
        grads = [s.grad for s in self.shards.values() if s.grad is not None]
        return clip_sharded_grad_norm_(grads, max_norm, self.comms)

    # --- the step: update the shards, all-gather the parameters ---------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        self._finish_if_pending()  # not done by the caller
        self.synchronized = False  # the next step needs the next backward's gradients
        loss = self.optim.step(closure)
        works = []
        for layout in self.layouts:
            row = layout.row_of([self.shards[p] for p in layout.params], layout.dtype)
            packed = row.new_empty(self.dp_world_size, layout.row_numel)
            works.append((layout, self.comms.all_gather(packed.view(-1), row, async_op=True), packed))
        for layout, work, packed in works:
            self.comms.wait(work)
            layout.unpack_into(packed, [p.data for p in layout.params])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.optim.zero_grad(set_to_none=set_to_none)

    # --- checkpoints: the unsharded optimizer's format --------------------------------------------

    def state_dict(self) -> dict:
        return full_optimizer_state(self.optim, self.full_params, self.layout_of, self.state_comms)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        self.refresh_masters()
        load_full_optimizer_state(self.optim, state_dict, self.full_params, self.layout_of)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state  # new objects

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Copy the parameters into fp32 master shards (after the model's weights were loaded)."""
        for p, shard in self.shards.items():
            layout, i = self.layout_of[p]
            if shard.data_ptr() != layout.owned(i, p.detach()).data_ptr():
                shard.copy_(layout.owned(i, p.detach()))


class Zero(CommsStrategy):
    """The trainer's ZeRO-1/2 strategy: the model as is, the optimizer a :class:`ShardedOptimizer`."""

    stage = 1

    def __init__(self, model, make_optimizer, group=None, **sharded_kwargs):
        super().__init__(model, make_optimizer, group)
        broadcast_module(model, self.comms)
        self.comms.reset()
        self.optimizer = ShardedOptimizer.from_optimizer(
            self.optimizer, process_group=group, comms=self.comms, shard_gradients=self.stage == 2,
            **sharded_kwargs)

    @property
    def pending(self) -> list:  # collectives in flight (course_lib.experiments.memory_measure)
        return self.optimizer.pending

    def no_sync(self):
        return self.optimizer.no_sync()

    def stepped_tensors(self) -> dict[nn.Parameter, nn.Parameter]:
        return self.optimizer.shards  # frozen parameters have none: they stay as they are

    def state_order(self) -> list[nn.Parameter]:
        return self.optimizer.full_params

    def finish_grads(self) -> None:
        self.optimizer.finish_gradient_synchronization()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.optimizer.clip_grad_norm_(max_norm)

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class Zero1(Zero):
    name, stage = "zero1", 1


class Zero2(Zero):
    name, stage = "zero2", 2
