"""ZeRO stage 3: parameters sharded too, gathered just in time (Rajbhandari et al. 2020, Sec. 5.3).

Between steps a rank holds only its 1/N shard of every parameter, gradient and optimizer state:
(4 + 4 + 8) Psi / N bytes for Adam in fp32. The model is cut into *units* (by default every entry
of every ``nn.ModuleList``, e.g. GPT's transformer blocks, plus the root module for the rest):

    forward of a unit:   all-gather its parameters -> compute -> free them again
    backward of a unit:  all-gather its parameters -> compute -> reduce-scatter its gradients,
                         free the parameters and the full gradients

so at most one unit is whole at a time (plus the root, which is gathered once for forward and
backward, as FSDP does: its backward follows its forward immediately). Per step each rank moves
Psi (forward all-gather) + Psi (backward all-gather) + Psi (reduce-scatter) = 3 Psi, 1.5x data
parallelism (paper Sec. 7.2.2); the root's parameters are gathered once, so 3 Psi - Psi_root.

How parameters are freed: every parameter keeps its full shape but its storage is resized to
zero bytes; gathering resizes it back and copies the values in. Autograd saved the parameter
tensor (same storage) during forward, so the re-gathered values are what backward reads.
Gradient accumulation: every backward reduce-scatters and the shards accumulate (no full
gradients are kept between micro-batches, so ``no_sync`` does not save communication here).
"""

from __future__ import annotations

import torch
from torch import nn

from course_lib.parallel.zero import ShardedStrategy, ShardLayout


def default_units(model: nn.Module) -> list[nn.Module]:
    """Every entry of every ModuleList (transformer blocks, toy layers)."""
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]


class Unit:
    """A module whose own parameters are gathered and freed together."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], rank: int, world_size: int,
                 is_root: bool):
        self.module, self.params, self.is_root = module, params, is_root
        self.layout = ShardLayout(params, rank, world_size)
        self.gathered = True  # parameters start whole
        self.ready: set[nn.Parameter] = set()


def _tensors(obj) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


class Zero3(ShardedStrategy):
    name = "zero3"
    stage = 3

    def __init__(self, model, make_optimizer, group=None, units: list[nn.Module] | None = None):
        super().__init__(model, make_optimizer, group)
        units = [u for u in (default_units(model) if units is None else units) if u is not model]
        owner = _owners(model, units)  # parameter -> the innermost unit that uses it
        self.units: list[Unit] = []
        for module in [model] + units:
            params = [p for p in self.params if owner[p] is module]
            if params:
                self.units.append(Unit(module, params, self.dp_rank, self.dp_world_size,
                                       is_root=module is model))
        self.unit_of = {p: u for u in self.units for p in u.params}
        self.row: dict[Unit, torch.Tensor] = {}  # each unit's shards, one flat buffer
        with torch.no_grad():
            for unit in self.units:
                row = unit.layout.pack([p.data for p in unit.params])[self.dp_rank].clone()
                self.row[unit] = row
                for i, p in enumerate(unit.params):
                    self.layout_of[p] = (unit.layout, i)
                    self.shards[p] = nn.Parameter(unit.layout.in_row(i, row))
                    p.data = torch.empty_like(p.data)  # own storage, so it can be freed alone
                self._reshard(unit)
        self.optimizer = self.build_sharded_optimizer()
        self.pending = []
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda m, args, unit=unit: self._gather(unit))
            unit.module.register_forward_hook(
                lambda m, args, out, unit=unit: self._after_forward(unit, out))
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # --- parameters: gather for use, free after -------------------------------------------------

    @torch.no_grad()
    def _gather(self, unit: Unit) -> None:
        if unit.gathered:
            return
        packed = self.row[unit].new_empty(self.dp_world_size, unit.layout.row_numel)
        self.comms.all_gather(packed.view(-1), self.row[unit])
        for p in unit.params:
            p.untyped_storage().resize_(p.numel() * p.element_size())
        unit.layout.unpack_into(packed, [p.data for p in unit.params])
        unit.gathered = True

    def _reshard(self, unit: Unit) -> None:
        for p in unit.params:
            p.untyped_storage().resize_(0)
        unit.gathered = False

    def _after_forward(self, unit: Unit, output) -> None:
        if not torch.is_grad_enabled():  # evaluation or generation: no backward follows
            if unit.is_root:
                for u in self.units:
                    if u.gathered:
                        self._reshard(u)
            else:
                self._reshard(unit)
            return
        if unit.is_root:
            return  # backward starts right away: keep the root whole until its gradients are done
        self._reshard(unit)
        for t in _tensors(output):  # the gradient of the output arrives just before the unit's
            if t.requires_grad:     # backward: gather the parameters again then
                t.register_hook(lambda grad, unit=unit: self._gather(unit))

    # --- gradients: reduce-scatter per unit as soon as backward finished it ---------------------

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        unit = self.unit_of[p]
        unit.ready.add(p)
        if len(unit.ready) == len(unit.params):
            self._reduce_scatter(unit)

    @torch.no_grad()
    def _reduce_scatter(self, unit: Unit) -> None:
        packed = unit.layout.pack([p.grad for p in unit.params], scale=1.0 / self.dp_world_size)
        for p in unit.params:
            p.grad = None
        row = packed.new_empty(unit.layout.row_numel)
        work = self.comms.reduce_scatter(row, packed.view(-1), async_op=True)
        self.pending.append((unit, work, row, packed))
        unit.ready.clear()
        self._reshard(unit)

    @torch.no_grad()
    def finish_grads(self) -> None:
        for unit in self.units:  # units with parameters that got no gradient
            if unit.ready:
                self._reduce_scatter(unit)
            elif unit.gathered:
                self._reshard(unit)
        for unit, work, row, _ in self.pending:
            self.comms.wait(work)
            for i, p in enumerate(unit.params):
                shard = self.shards[p]
                g = unit.layout.in_row(i, row)
                shard.grad = g if shard.grad is None else shard.grad.add_(g)
        self.pending.clear()

    def step(self) -> None:
        self.optimizer.step()  # the shards are the parameters: nothing to gather until forward

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    # --- checkpoints -----------------------------------------------------------------------------

    @torch.no_grad()
    def state_dict(self) -> dict:
        full = {id(p): self.gather_full(p, self.shards[p]).clone() for p in self.params}
        model = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            model[name] = full[id(t)] if id(t) in full else t.detach().clone()
        return {"model": model, "optimizer": self.optimizer_state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        by_id = {id(t): name for name, t in self.module.state_dict(keep_vars=True).items()}
        for name, buf in self.module.named_buffers():
            if name in state["model"]:
                buf.copy_(state["model"][name])
        for p in self.params:
            layout, i = self.layout_of[p]
            self.shards[p].copy_(layout.owned(i, state["model"][by_id[id(p)]]))
        self.load_optimizer_state_dict(state["optimizer"])


def _owners(model: nn.Module, units: list[nn.Module]) -> dict[nn.Parameter, nn.Module]:
    """Map each parameter to the innermost unit (or the root) whose forward uses it; a parameter
    used by two units would be freed under the other's feet, so that is an error."""
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
