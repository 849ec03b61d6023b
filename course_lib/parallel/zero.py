"""ZeRO stages 1 and 2 on torch.distributed collectives (Rajbhandari et al. 2020, "ZeRO").

Plain data parallelism keeps a full copy of the model states on every rank: parameters,
gradients and optimizer states (for Adam in fp32: 4 + 4 + 8 bytes per parameter, 16 Psi). ZeRO
removes the redundancy stage by stage; with N ranks:

* stage 1 (P_os) shards the optimizer states: each rank updates 1/N of every parameter;
  after backward the gradients are reduce-scattered (each rank receives the averaged 1/N it
  updates) and after the step the updated parameters are all-gathered.  4 + 4 + 8/N per parameter.
* stage 2 (P_os+g) also shards the gradients: a bucket's gradients are reduce-scattered as soon as
  backward produced them and the full ones are freed, so no rank ever holds all of them.
  4 + (4 + 8)/N.
* stage 3 (P_os+g+p) also shards the parameters: see :mod:`course_lib.parallel.zero3`.

Communication per rank and step: reduce-scatter (Psi) + all-gather (Psi) = 2 Psi, the volume of
one all-reduce (paper Sec. 7.2.1), so stages 1 and 2 cost what data parallelism costs.

How a parameter is sharded (the same in all stages): flattened and zero-padded to a multiple of N,
rank r owns the r-th of N equal chunks. One collective serves a whole bucket of parameters through
a packed (N, row) buffer whose row r holds rank r's chunk of every parameter in the bucket
(:class:`ShardLayout`). The optimizer is the trainer's own optimizer class and hyper-parameters,
rebuilt over the shards; AdamW is element-wise, so updating shards equals updating the whole.
In fp32 a rank's shard is a view into the full parameter (no copy); with 16-bit parameters it is
an fp32 master copy, as in mixed-precision ZeRO.

Gradient accumulation: stage 1 accumulates full gradients locally and communicates once, after
the last micro-batch; stage 2 keeps no full gradients, so it reduce-scatters every micro-batch and
sums the shards (``no_sync`` saves no communication there, as with FSDP's default).

Checkpoints: ``state_dict()`` gathers the FULL model and optimizer state, in the format of the
trainer's unsharded optimizer, identical on every rank (a collective: call it on all ranks).
A checkpoint of any strategy therefore loads into any other, at any number of ranks.
"""

from __future__ import annotations

import inspect
import math
from itertools import accumulate

import torch
from torch import nn

from course_lib.parallel.comms import Comms, broadcast_module
from course_lib.parallel.strategy import CommsStrategy, Strategy

ZERO_STAGES = (0, 1, 2, 3)


def check_stage(stage) -> int:
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3 (0: plain data parallel, 1: shard "
                         f"optimizer states, 2: + gradients, 3: + parameters), got {stage!r}")
    return stage


class ShardLayout:
    """Per-parameter shards of a group of parameters, packed so one collective moves them all.

    Parameter i (n_i elements) is padded to N * s_i with s_i = ceil(n_i / N); rank r owns its
    flat elements [r s_i, (r+1) s_i) clipped to n_i (the last ranks' shards may be short or empty).
    """

    def __init__(self, params: list[nn.Parameter], rank: int, world_size: int):
        self.params, self.rank, self.world_size = list(params), rank, world_size
        self.shard_numels = [math.ceil(p.numel() / world_size) for p in self.params]
        self.offsets = list(accumulate([0] + self.shard_numels))  # param i's place in a row
        self.row_numel = self.offsets[-1]

    def owned_range(self, i: int) -> tuple[int, int]:
        s, n = self.shard_numels[i], self.params[i].numel()
        return min(self.rank * s, n), min((self.rank + 1) * s, n)

    def owned(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full-shaped tensor (a view)."""
        start, end = self.owned_range(i)
        return full.reshape(-1)[start:end]

    def in_row(self, i: int, row: torch.Tensor) -> torch.Tensor:
        """Param i's (unpadded) shard inside a (row_numel,) buffer of this rank."""
        start, end = self.owned_range(i)
        return row[self.offsets[i]: self.offsets[i] + end - start]

    def pack(self, tensors: list[torch.Tensor | None], scale: float = 1.0) -> torch.Tensor:
        """Full-shaped tensors (None: zeros) -> (N, row_numel), row r = rank r's chunks."""
        p0 = self.params[0]
        packed = torch.zeros(self.world_size, self.row_numel, dtype=p0.dtype, device=p0.device)
        for i, t in enumerate(tensors):
            if t is None:
                continue
            s, n = self.shard_numels[i], t.numel()
            flat = t.reshape(-1)
            if n < self.world_size * s:
                flat = torch.cat([flat, flat.new_zeros(self.world_size * s - n)])
            packed[:, self.offsets[i]: self.offsets[i] + s].copy_(flat.view(self.world_size, s))
        return packed.mul_(scale) if scale != 1.0 else packed

    def unpack_into(self, packed: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """(N, row_numel) -> write every parameter's full value into ``tensors``."""
        for i, t in enumerate(tensors):
            cols = packed[:, self.offsets[i]: self.offsets[i] + self.shard_numels[i]]
            t.copy_(cols.reshape(-1)[: t.numel()].view_as(t))


def buckets_of(params: list[nn.Parameter], bucket_cap_mb: float) -> list[list[nn.Parameter]]:
    """Consecutive groups of about ``bucket_cap_mb`` (reversed: backward order), like DDP."""
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    out, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_cap_mb * 2**20:
            out.append(current)
            current, size = [], 0
    return out + [current] if current else out


class ShardedStrategy(CommsStrategy):
    """What all ZeRO stages share: sharded optimizer, global-norm clipping, full checkpoints."""

    def __init__(self, model, make_optimizer, group=None):
        super().__init__(model, make_optimizer, group)
        self.state_comms = Comms(group)  # checkpoint traffic, kept out of the per-step figures
        broadcast_module(model, self.comms)
        self.comms.reset()
        # every trainable parameter once (tied weights are one Parameter), in the optimizer's order
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        if len({id(p) for p in self.params}) != len(self.params) or \
                {id(p) for p in self.params} != trainable:
            raise ValueError("ZeRO shards what the optimizer holds: make_optimizer(model) must "
                             "hold every trainable parameter of the model exactly once")
        self.full_optimizer = self.optimizer  # kept for its param_groups' hyper-parameters only
        self.layout_of: dict[nn.Parameter, tuple[ShardLayout, int]] = {}
        self.shards: dict[nn.Parameter, nn.Parameter] = {}  # module param -> its shard

    def build_sharded_optimizer(self) -> torch.optim.Optimizer:
        """The trainer's optimizer class and groups, over this rank's shards."""
        full = self.full_optimizer
        accepted = inspect.signature(type(full)).parameters
        kwargs = {k: v for k, v in full.defaults.items() if k in accepted and k != "params"}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self.shards[p] for p in g["params"]]} for g in full.param_groups]
        return type(full)(groups, **kwargs)

    def shard_grads(self) -> list[torch.Tensor]:
        return [s.grad for s in self.shards.values() if s.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole gradient: sum of squares of the shards, all-reduced."""
        grads = self.shard_grads()
        sq = torch.zeros((), device=self.params[0].device, dtype=torch.float32)
        for g in grads:
            sq += g.float().pow(2).sum()
        self.comms.all_reduce(sq)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # the rule of torch's clip_grad_norm_
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    # --- checkpoints: full state, identical on every rank --------------------------------------

    def gather_full(self, p: nn.Parameter, shard: torch.Tensor) -> torch.Tensor:
        layout, i = self.layout_of[p]
        row = shard.new_zeros(layout.shard_numels[i])
        row[: shard.numel()] = shard
        out = shard.new_empty(layout.world_size * layout.shard_numels[i])
        self.state_comms.all_gather(out, row)
        return out[: p.numel()].view(p.shape)

    def optimizer_state_dict(self) -> dict:
        sd = self.optimizer.state_dict()  # indices follow the param_groups order of self.params
        state = {}
        for idx, per_param in sd["state"].items():
            p = self.params[idx]
            state[idx] = {k: self.gather_full(p, v) if torch.is_tensor(v) and v.dim() > 0 else v
                          for k, v in per_param.items()}
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_optimizer_state_dict(self, full: dict) -> None:
        state = {}
        for idx, per_param in full["state"].items():
            p = self.params[int(idx)]
            layout, i = self.layout_of[p]
            state[idx] = {k: (layout.owned(i, v) if v.dim() > 0 else v).clone()
                          if torch.is_tensor(v) else v for k, v in per_param.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})


class Zero(ShardedStrategy):
    """ZeRO stage 1 or 2 over the data-parallel group (see the module docstring)."""

    def __init__(self, model, make_optimizer, group=None, stage: int = 1, bucket_cap_mb: float = 25):
        if check_stage(stage) not in (1, 2):
            raise ValueError(f"Zero implements stages 1 and 2; use zero_strategy() for stage {stage}")
        super().__init__(model, make_optimizer, group)
        self.stage = stage
        self.layouts = [ShardLayout(b, self.dp_rank, self.dp_world_size)
                        for b in buckets_of(self.params, bucket_cap_mb)]
        for layout in self.layouts:
            for i, p in enumerate(layout.params):
                self.layout_of[p] = (layout, i)
                shard = layout.owned(i, p.detach())  # fp32: a view, the update lands in p itself
                if p.dtype != torch.float32:  # 16-bit parameters: an fp32 master copy
                    shard = shard.float().clone()
                self.shards[p] = nn.Parameter(shard)
        self.optimizer = self.build_sharded_optimizer()
        self.pending = []  # (layout, async work, output row, packed input kept alive)
        self.ready: dict[ShardLayout, set] = {layout: set() for layout in self.layouts}
        if stage == 2:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @torch.no_grad()
    def _reduce_scatter(self, layout: ShardLayout) -> None:
        """Average a bucket's gradients and leave each rank its shard; free the full gradients."""
        packed = layout.pack([p.grad for p in layout.params], scale=1.0 / self.dp_world_size)
        for p in layout.params:
            p.grad = None
        row = packed.new_empty(layout.row_numel)
        work = self.comms.reduce_scatter(row, packed.view(-1), async_op=True)
        self.pending.append((layout, work, row, packed))
        self.ready[layout].clear()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        layout, _ = self.layout_of[p]
        self.ready[layout].add(p)
        if len(self.ready[layout]) == len(layout.params):
            self._reduce_scatter(layout)  # stage 2: overlapped with the rest of backward

    @torch.no_grad()
    def finish_grads(self) -> None:
        for layout in self.layouts:  # stage 1: everything; stage 2: buckets with unused params
            if self.stage == 1 or self.ready[layout]:
                self._reduce_scatter(layout)
        for layout, work, row, _ in self.pending:
            self.comms.wait(work)
            for i, p in enumerate(layout.params):
                g = layout.in_row(i, row).to(self.shards[p].dtype)
                shard = self.shards[p]
                shard.grad = g if shard.grad is None else shard.grad.add_(g)
        self.pending.clear()

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's shards, then all-gather the updated parameters to every rank."""
        self.optimizer.step()
        works = []
        for layout in self.layouts:
            row = layout.params[0].new_zeros(layout.row_numel)
            for i, p in enumerate(layout.params):
                layout.in_row(i, row).copy_(self.shards[p])
            packed = row.new_empty(self.dp_world_size, layout.row_numel)
            works.append((layout, self.comms.all_gather(packed.view(-1), row, async_op=True), packed))
        for layout, work, packed in works:
            self.comms.wait(work)
            layout.unpack_into(packed, [p.data for p in layout.params])

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer_state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        for p, shard in self.shards.items():
            layout, i = self.layout_of[p]
            if shard.data_ptr() != layout.owned(i, p.detach()).data_ptr():
                shard.copy_(layout.owned(i, p.detach()))  # refresh an fp32 master copy
        self.load_optimizer_state_dict(state["optimizer"])


class Zero1(Zero):
    name = "zero1"

    def __init__(self, model, make_optimizer, group=None, bucket_cap_mb: float = 25):
        super().__init__(model, make_optimizer, group, stage=1, bucket_cap_mb=bucket_cap_mb)


class Zero2(Zero):
    name = "zero2"

    def __init__(self, model, make_optimizer, group=None, bucket_cap_mb: float = 25):
        super().__init__(model, make_optimizer, group, stage=2, bucket_cap_mb=bucket_cap_mb)


def zero_strategy(model, make_optimizer, stage: int, group=None, **kwargs) -> Strategy:
    """ZeRO at ``stage``: 0 is plain data parallelism (our bucketed DDP), 1-2 :class:`Zero`,
    3 :class:`~course_lib.parallel.zero3.Zero3`."""
    check_stage(stage)
    if stage == 0:
        from course_lib.parallel.data_parallel import DDP
        return DDP(model, make_optimizer, group, **kwargs)
    if stage == 3:
        from course_lib.parallel.zero3 import Zero3
        return Zero3(model, make_optimizer, group, **kwargs)
    return Zero(model, make_optimizer, group, stage=stage, **kwargs)
