"""ZeRO-3 / FSDP units: the modules whose parameters are gathered and freed together.

By default every entry of every ``nn.ModuleList`` (GPT's transformer blocks, the toy's layers) is
a unit, and the root module is one more unit for whatever parameters are left (embeddings, final
norm, head), as FSDP's auto-wrap policies do (Zhao et al. 2023, "PyTorch FSDP", Sec. 3.2.1).
A parameter belongs to the innermost unit that contains it; a parameter used by two units would be
freed under the other's feet, so that is an error (tie weights inside one unit, e.g. the root).

A :class:`Unit` is "free" (its parameters' storage resized to zero bytes), "gathering" (an
asynchronous all-gather of the ranks' shards in flight) or "gathered" (whole). As in FSDP2, the
module shows its fp32 shards as its parameters while the unit is free (they carry ``.grad`` after
backward), and the whole compute-dtype tensors only while it is gathered (``Unit.slots``).
"""

from __future__ import annotations

import torch
from torch import nn

from course_lib.parallel.zero.sharding import ShardLayout


def default_units(model: nn.Module) -> list[nn.Module]:
    """Every entry of every ModuleList (transformer blocks, toy layers)."""
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]


def owners(model: nn.Module, units: list[nn.Module]) -> dict[nn.Parameter, nn.Module]:
    """Each parameter -> the innermost unit (or the root ``model``) that holds it."""
    unit_ids = {id(u) for u in units}
    users: dict[nn.Parameter, dict[int, nn.Module]] = {}
    names: dict[nn.Parameter, str] = {}

    def visit(module: nn.Module, unit: nn.Module, prefix: str) -> None:
        unit = module if id(module) in unit_ids else unit
        for name, p in module.named_parameters(recurse=False):
            users.setdefault(p, {})[id(unit)] = unit
            names.setdefault(p, prefix + name)
        for name, child in module.named_children():
            visit(child, unit, f"{prefix}{name}.")

    visit(model, model, "")
    for p, by in users.items():
        if len(by) > 1:
            raise ValueError(f"parameter {names[p]!r} is used by {len(by)} ZeRO-3 units "
                             f"({', '.join(type(u).__name__ for u in by.values())}); tie weights "
                             "inside one unit (e.g. the root) or pass units= without the split")
    return {p: next(iter(by.values())) for p, by in users.items()}


def map_tensors(fn, obj):
    """``obj`` (a module's inputs or output: a tensor, or tuples / named tuples / lists / dicts of
    them) with each tensor ``t`` replaced by ``fn(t)``; anything else is kept."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(map_tensors(fn, o) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors of a module's output (in :func:`map_tensors`' sense), in order."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, obj)
    return found


def cast_floating(x, dtype: torch.dtype):
    """A floating-point tensor in ``dtype`` (a module input under mixed precision); else ``x``."""
    return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x


class Unit:
    """A module whose own sharded parameters are gathered and freed together."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], rank: int, world_size: int):
        self.module, self.params = module, params
        self.layout = ShardLayout(params, rank, world_size)
        self.state = "gathered"  # "free" -> "gathering" -> "gathered" -> "free"
        self.row: torch.Tensor | None = None  # this rank's fp32 master shards, one flat buffer
        self.gather = None  # (work, packed output, input row) while gathering
        # post-backward bookkeeping (course_lib.parallel.zero.zero3): per forward (its number), how
        # many of this unit's post-backward points are still to come in that forward's backward,
        # and the forwards that ran it without such a point (it is reduced at their backward's end)
        self.due: dict[int, int] = {}
        self.unhooked: set[int] = set()
        # (module, attribute, whole tensor, fp32 shard) for every place a parameter is registered
        # (a tied weight: two); set by the wrapper once the shards exist
        self.slots: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []

    def show(self, whole: bool) -> None:
        """Register the whole tensors (gathered) or the shards (free) as the modules' parameters:
        FSDP2 swaps them the same way, so a module's ``parameters()`` outside forward and backward
        are the shards, with their gradients. The shards are what a user freezes between steps
        (``requires_grad_``): the whole tensors, computed with while shown, follow them."""
        for module, attr, p, shard in self.slots:
            if whole:
                p.requires_grad_(shard.requires_grad)
            module._parameters[attr] = p if whole else shard

    @torch.no_grad()
    def start_gather(self, comms) -> None:
        """Issue the all-gather of this unit's shards in the parameters' dtype (16-bit under a
        compute dtype; parameters of several dtypes: the widest, each gets its own back); returns
        at once."""
        if self.state != "free":
            return
        row = self.row.to(self.layout.dtype)
        packed = row.new_empty(self.layout.world_size, self.layout.row_numel)
        self.gather = (comms.all_gather(packed.view(-1), row, async_op=True), packed, row)
        self.state = "gathering"

    @torch.no_grad()
    def wait_gather(self, comms) -> None:
        """Make the parameters whole: wait for the all-gather (issued now if it was not)."""
        if self.state == "gathered":
            return
        self.start_gather(comms)
        work, packed, _ = self.gather
        comms.wait(work)
        for p in self.params:
            p.untyped_storage().resize_(p.numel() * p.element_size())
        self.layout.unpack_into(packed, [p.data for p in self.params])
        self.gather, self.state = None, "gathered"
        self.show(whole=True)

    def reshard(self, comms) -> None:
        """Free the parameters' storage (after any all-gather in flight finished)."""
        if self.state == "gathering":
            comms.wait(self.gather[0])
            self.gather = None
        for p in self.params:
            p.untyped_storage().resize_(0)
        self.state = "free"
        self.show(whole=False)
