"""How ZeRO cuts parameters into shards, and packs a group of them so that one collective moves all.

Used by both ZeRO wrappers (:mod:`course_lib.parallel.zero.zero12`, :mod:`course_lib.parallel.zero.zero3`).
A parameter of n elements is flattened and zero-padded to N * s with s = ceil(n / N); rank r owns
flat elements [r s, (r+1) s) clipped to n (the last ranks' shards may be short or empty). Each
parameter is cut on its own, as DeepSpeed's ZeRO-3 cuts a parameter's flattened elements. PyTorch's
FSDP cuts differently: FSDP1 (Zhao et al. 2023, Sec. 3.2) flattens and concatenates all of a
unit's parameters into one FlatParameter and cuts that; FSDP2 cuts each parameter along dim 0 of
its own shape.

A group of parameters is packed into an (N, row) buffer whose row r holds rank r's chunk of every
parameter, so a reduce-scatter hands rank r exactly its row and an all-gather of the rows rebuilds
every parameter. Gradient buffers carry one more column per parameter: 1 where this rank has a
gradient for it, 0 where it has none (``grad is None``). Reduced, the column says on how many ranks
the parameter got a gradient; 0 means nowhere, and then, as in one process, the parameter gets no
gradient and the optimizer leaves it alone (AdamW would otherwise decay it). The flags ride in the
same message, so agreeing costs no extra collective.

A group may mix dtypes (an fp32 norm beside bf16 weights): parameter values then travel in
``ShardLayout.dtype``, the widest of them (:func:`course_lib.parallel.data.buckets.common_dtype`), and
each parameter gets its own dtype back, as one process would keep it.
"""

from __future__ import annotations

import inspect
import math
from itertools import accumulate

import torch
from torch import nn

from course_lib.parallel.data.buckets import common_dtype


class ShardLayout:
    """Per-parameter shards of ``params`` on ``rank`` of ``world_size``, packed in rows."""

    def __init__(self, params: list[nn.Parameter], rank: int, world_size: int):
        self.params, self.rank, self.world_size = list(params), rank, world_size
        self.shard_numels = [math.ceil(p.numel() / world_size) for p in self.params]
        self.offsets = list(accumulate([0] + self.shard_numels))  # param i's place in a row
        self.row_numel = self.offsets[-1]
        self.grad_row_numel = self.row_numel + len(self.params)  # + the presence flags
        # parameter values travel in the widest of their dtypes (one dtype: that one)
        self.dtype = common_dtype(self.params) if self.params else torch.float32

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

    def pack(self, tensors: list[torch.Tensor | None], dtype: torch.dtype, scale: float = 1.0,
             presence: bool = False) -> torch.Tensor:
        """Full-shaped tensors (None: zeros) -> (N, row_numel [+ len(params) flags]) in ``dtype``."""
        p0 = self.params[0]
        width = self.grad_row_numel if presence else self.row_numel
        packed = torch.zeros(self.world_size, width, dtype=dtype, device=p0.device)
        for i, t in enumerate(tensors):
            if t is None:
                continue
            s, n = self.shard_numels[i], t.numel()
            flat = t.reshape(-1).to(dtype)
            if n < self.world_size * s:
                flat = torch.cat([flat, flat.new_zeros(self.world_size * s - n)])
            packed[:, self.offsets[i]: self.offsets[i] + s].copy_(flat.view(self.world_size, s))
        if scale != 1.0:
            packed[:, : self.row_numel].mul_(scale)
        if presence:
            flags = torch.tensor([t is not None for t in tensors], dtype=dtype, device=p0.device)
            packed[:, self.row_numel:] = flags  # the same flags in every rank's row
        return packed

    def present(self, grad_row: torch.Tensor) -> list[bool]:
        """From a reduced gradient row: did parameter i get a gradient on any rank?"""
        return (grad_row[self.row_numel:] > 0).tolist()

    def unpack_into(self, packed: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """(N, row_numel) -> write every parameter's full value into ``tensors``."""
        for i, t in enumerate(tensors):
            cols = packed[:, self.offsets[i]: self.offsets[i] + self.shard_numels[i]]
            t.copy_(cols.reshape(-1)[: t.numel()].view_as(t))

    def row_of(self, shards: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This rank's (row_numel,) row from its shards, in ``dtype`` (for an all-gather)."""
        row = torch.zeros(self.row_numel, dtype=dtype, device=self.params[0].device)
        for i, shard in enumerate(shards):
            self.in_row(i, row).copy_(shard)
        return row


def split_trainable(params) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(trainable, frozen), each parameter once (tied weights are one Parameter), order kept."""
    seen, trainable, frozen = set(), [], []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            (trainable if p.requires_grad else frozen).append(p)
    return trainable, frozen


def reduce_into(shard: nn.Parameter, grad: torch.Tensor) -> None:
    """Accumulate a reduced gradient shard into ``shard.grad`` (created on first use)."""
    grad = grad.to(shard.dtype)
    if shard.grad is None:
        shard.grad = grad.clone()
    else:
        shard.grad.add_(grad)


def optimizer_kwargs(opt: torch.optim.Optimizer) -> dict:
    """The constructor arguments of ``opt`` (its defaults that its class accepts)."""
    accepted = inspect.signature(type(opt)).parameters
    return {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}


def regroup_params(param_groups: list[dict], new_of: dict) -> list[dict]:
    """The same groups and options over other tensors: ``new_of[p]`` for each parameter p."""
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [new_of[p] for p in g["params"]]} for g in param_groups]


def gather_full(comms, layout: ShardLayout | None, i: int, shard: torch.Tensor) -> torch.Tensor:
    """The full tensor of parameter i of ``layout`` from every rank's ``shard`` (a collective).
    ``layout=None``: the tensor is replicated, returned as it is."""
    if layout is None:
        return shard
    row = shard.new_zeros(layout.shard_numels[i])
    row[: shard.numel()] = shard
    out = shard.new_empty(layout.world_size * layout.shard_numels[i])
    comms.all_gather(out, row)
    p = layout.params[i]
    return out[: p.numel()].view(p.shape)


def full_optimizer_state(optim: torch.optim.Optimizer, params: list, layout_of: dict, comms) -> dict:
    """The state dict an unsharded optimizer over ``params`` would have: every sharded state
    tensor gathered (a collective: call on every rank). ``optim`` holds the shards in the same
    group order as ``params``; ``layout_of[p]`` is (layout, index) or absent for replicated."""
    sd = optim.state_dict()
    state = {}
    for idx, per_param in sd["state"].items():
        layout, i = layout_of.get(params[idx], (None, 0))
        state[idx] = {k: gather_full(comms, layout, i, v).clone()
                      if torch.is_tensor(v) and v.dim() > 0 else v for k, v in per_param.items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_optimizer_state(optim: torch.optim.Optimizer, full: dict, params: list,
                              layout_of: dict) -> None:
    """Inverse of :func:`full_optimizer_state`: keep this rank's shard of every state tensor."""
    state = {}
    for idx, per_param in full["state"].items():
        layout, i = layout_of.get(params[int(idx)], (None, 0))
        state[idx] = {k: (layout.owned(i, v) if layout is not None and v.dim() > 0 else v).clone()
                      if torch.is_tensor(v) else v for k, v in per_param.items()}
    optim.load_state_dict({"state": state, "param_groups": full["param_groups"]})


@torch.no_grad()
def clip_sharded_grad_norm_(grads: list[torch.Tensor], max_norm: float, comms,
                            replicated: list[torch.Tensor] = ()) -> torch.Tensor:
    """Clip by the norm of the whole gradient (torch's clip_grad_norm_ rule, coefficient
    max_norm / (norm + 1e-6) capped at 1): squares of the shards summed over ranks, plus the
    replicated gradients (the same on every rank) once."""
    device = (list(grads) + list(replicated) + [torch.zeros(())])[0].device
    sq = torch.zeros((), device=device, dtype=torch.float32)
    for g in grads:
        sq += g.float().pow(2).sum()
    comms.all_reduce(sq)
    for g in replicated:
        sq += g.float().pow(2).sum()
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in list(grads) + list(replicated):
        g.mul_(coef.to(g.dtype))
    return total
