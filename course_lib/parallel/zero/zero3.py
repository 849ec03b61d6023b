"""ZeRO stage 3 as a module wrapper: parameters sharded too, gathered just in time
(Rajbhandari et al. 2020, "ZeRO", Sec. 5.3; Zhao et al. 2023, "PyTorch FSDP").

    model = FullyShardedDataParallel(gpt, compute_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)       # over this rank's fp32 shards
    model(x, y)[1].backward(); model.finish_gradient_synchronization(); opt.step()

Mirrors PyTorch's ``FullyShardedDataParallel`` (FSDP1, ``use_orig_params=True``) and FSDP2's
``fully_shard`` with a ``MixedPrecisionPolicy``: ``named_parameters()`` are the local fp32 shards
under the module's names, ``summon_full_params()`` gathers the model, ``state_dict()`` is full.
FSDP2's convention holds for the wrapped module too: outside forward and backward its own
parameters are these fp32 shards (flat: this rank's slice of each parameter), and after backward
and ``finish_gradient_synchronization()`` they carry their reduced gradients, in fp32. The whole
compute-dtype tensors stand in their place only while their unit is gathered.

Between steps a rank holds 1/N of every parameter, gradient and optimizer state: (4 + 4 + 8) Psi
/ N bytes for Adam in fp32. The model is cut into units (:mod:`course_lib.parallel.zero.units`):

    forward of a unit:   wait for its all-gather -> start the next ``prefetch`` units' -> compute
                         -> free its parameters
    backward of a unit:  wait for its all-gather -> start the previous units' -> compute ->
                         reduce-scatter its gradients (async) and free parameters and gradients

so communication overlaps computation, and at most 1 + ``prefetch`` units are whole at a time
(plus the root, gathered once for forward and backward as in FSDP). The order of units is recorded
in the first forward and reversed for backward (FSDP1 fixes its order after the first iteration
in the same way; FSDP2 records it anew in every forward). Beyond ``max_in_flight``
reduce-scatters the oldest is completed and its gradient buffer freed. Per step each rank moves
3 Psi - Psi_root (paper Sec. 7.2.2).

Mixed precision: master shards are fp32; with ``compute_dtype`` (bf16/fp16) the shards are cast
and all-gathered in that dtype (half the bytes) and forward/backward run in it; gradients are
reduce-scattered in ``reduce_dtype`` (default fp32, pre-divided by N) into fp32 shard gradients;
the optimizer steps the fp32 shards. FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype).
Without ``compute_dtype`` each parameter computes in its own dtype; a unit mixing dtypes (an fp32
norm beside bf16 weights) is all-gathered in the widest of them.

``replicate(p) -> bool`` keeps chosen parameters (e.g. norms and biases: ``lambda p: p.dim() < 2``)
whole on every rank, their gradients all-reduced after backward (into their fp32 masters, where
they add up over backwards as the shards' do): a few more bytes per rank, no gather per use.
Frozen parameters are always kept whole (in ``compute_dtype``) and never stepped.
The experts of expert parallelism (flagged ``ep_sharded``: each rank holds other experts;
:mod:`course_lib.parallel.expert`) are left alone, as ZeRO-1/2 and DDP leave them: whole, their
gradients averaged by ``sync_expert_grads`` over their own group, stepped as they are.

A freed parameter keeps its shape, its storage resized to 0 bytes (autograd saved the tensor, so
backward reads the re-gathered values). Accumulation: every backward reduce-scatters and the
shards add up. Units must run alike on every rank (gathers are collectives).

Several forwards before their backwards (a pipeline schedule, AFAB or 1F1B: micro-batches in
flight) work too: every unit is gathered again before each backward that needs it (the root by a
hook on the forward's output, as the other units by hooks on theirs), and each backward
reduce-scatters into the shards' gradients, which add up.

Wrapping a module a second time (a re-run cell) raises: its parameters are shards by then.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from course_lib.parallel.comms import Comms, broadcast_module, ep_sharded
from course_lib.parallel.strategy import CommsStrategy
from course_lib.parallel.zero.sharding import (
    ShardLayout,
    clip_sharded_grad_norm_,
    full_optimizer_state,
    gather_full,
    load_full_optimizer_state,
    optimizer_kwargs,
    reduce_into,
    regroup_params,
    split_trainable,
)
from course_lib.parallel.zero.units import Unit, cast_floating, default_units, owners, tensors_in


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3 over ``module``; mirrors torch.distributed.fsdp.FullyShardedDataParallel.

    Known limit (found 2026-11-28, not fixed): a unit's reduce-scatter starts when all of its
    parameters have their gradients (:meth:`_on_grad_ready`). A parameter of a unit other than the
    root that gets a gradient on some ranks only (a branch taken by one rank's data) makes the
    ranks start that reduce-scatter at different points, one of them between the next unit's
    all-gathers: the collectives mismatch and the ranks hang until the collective timeout. The
    course's GPT never does this (its experts are one stacked parameter each, which every rank's
    backward reaches); zero1 and zero2 are not affected. The fix is FSDP2's rule, to start a
    unit's reduce-scatter at a point of backward every rank shares."""

    def __init__(self, module: nn.Module, process_group=None, *, units: list[nn.Module] | None = None,
                 compute_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
                 replicate=None, prefetch: int = 1, max_in_flight: int | None = 2,
                 comms: Comms | None = None):
        super().__init__()
        # A module wrapped already (a re-run cell) shows this rank's flat shards, not its parameters:
        # a second wrapper would broadcast rank 0's shards into shards of other sizes (the ranks
        # abort in gloo) and shard them again. Only the first wrapper can gather them: refuse.
        if any(getattr(m, "_course_fsdp_sharded", False) for m in module.modules()):
            raise RuntimeError(
                "FullyShardedDataParallel: this module (or a part of it) is wrapped already, and its "
                "parameters are now this rank's shards. Keep using the first wrapper, or build the "
                "model again (re-run the cell that creates it) before wrapping it.")
        self.module = module
        self.comms = comms or Comms(process_group)
        self.state_comms = Comms(process_group)  # checkpoint traffic, kept out of the step figures
        self.dp_world_size, rank = self.comms.world_size, self.comms.rank
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self.prefetch, self.max_in_flight = prefetch, max_in_flight
        broadcast_module(module, self.comms)  # every rank starts from rank 0's state
        self.names = {p: n for n, p in module.named_parameters()}  # tied weights: once
        trainable, frozen = split_trainable(self.names)
        own = [p for p in trainable if ep_sharded(p)]  # experts: left to parallel.expert
        if own and compute_dtype is not None:
            raise ValueError("ZeRO-3's compute_dtype with expert-parallel experts (ep > 1) is not supported: "
                             "the experts stay in their dtype; use autocast (the trainer's mixed precision)")
        trainable = [p for p in trainable if not ep_sharded(p)]
        keep = [p for p in trainable if replicate is not None and replicate(p)] + frozen
        sharded = [p for p in trainable if not any(p is k for k in keep)]
        units = [u for u in (default_units(module) if units is None else units) if u is not module]
        owner = owners(module, units)
        self.units = [Unit(m, [p for p in sharded if owner[p] is m], rank, self.dp_world_size)
                      for m in [module] + units if any(owner[p] is m for p in sharded)]
        self.root = next((u for u in self.units if u.module is module), None)
        self.unit_of = {p: u for u in self.units for p in u.params}
        self.layout_of: dict[nn.Parameter, tuple[ShardLayout, int]] = {}
        self.masters: dict[nn.Parameter, nn.Parameter] = {}  # whole parameter -> fp32 master
        registered = [(m, attr, p) for m in module.modules() for attr, p in m._parameters.items() if p is not None]
        self.masters.update({p: p for p in own})  # stepped whole, as they are
        with torch.no_grad():
            for unit in self.units:
                unit.row = unit.layout.pack([p.data for p in unit.params], torch.float32)[rank].clone()
                for i, p in enumerate(unit.params):
                    self.layout_of[p] = (unit.layout, i)
                    self.masters[p] = nn.Parameter(unit.layout.in_row(i, unit.row))
                    p.data = torch.empty(p.shape, dtype=compute_dtype or p.dtype, device=p.device)
                mine = {id(q) for q in unit.params}
                unit.slots = [(m, attr, q, self.masters[q]) for m, attr, q in registered if id(q) in mine]
                unit.reshard(self.comms)  # the module now shows the shards
            self.copies: list[nn.Parameter] = []  # replicated, computed in another dtype than the master
            for p in keep:
                if p.dtype == torch.float32 and compute_dtype in (None, torch.float32):
                    self.masters[p] = p
                else:
                    self.masters[p] = nn.Parameter(p.detach().float().clone(), p.requires_grad)
                    p.data = p.data.to(compute_dtype or p.dtype)
                    self.copies.append(p)
        self.replicated = [p for p in keep if p.requires_grad]
        copied = {id(p) for p in self.copies}  # whole in compute dtype: shown from forward to the end of backward
        self.copy_slots = [(m, attr, p, self.masters[p]) for m, attr, p in registered if id(p) in copied]
        self._show_copies(whole=False)
        for m in module.modules():  # read by the check above: a part, or a module holding it, too
            m._course_fsdp_sharded = True
        self.order: list[Unit] | None = None  # non-root units in forward order, after one forward
        self._recording: list[Unit] = []
        self.pending: list[tuple] = []  # (unit, work, grad row, packed input kept alive)
        for unit in self.units:
            if unit is not self.root:
                unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
                unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
        for p in sharded:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _show_copies(self, whole: bool) -> None:
        """Replicated parameters computed in another dtype: the 16-bit copy while in use, else the
        fp32 master (as :meth:`course_lib.parallel.zero.units.Unit.show` does for the sharded ones;
        the copy follows its master's ``requires_grad``, toggled by a user between steps)."""
        for module, attr, p, master in self.copy_slots:
            if whole:
                p.requires_grad_(master.requires_grad)
            module._parameters[attr] = p if whole else master

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The fp32 master shards (and replicated masters) under the module's parameter names."""
        for p, name in self.names.items():
            yield prefix + name, self.masters[p]

    # --- forward: gather just in time, prefetch the next units --------------------------------

    def forward(self, *args, **kwargs):
        with torch.no_grad():
            for p in self.copies:  # refresh 16-bit copies of replicated masters (after a step)
                p.copy_(self.masters[p])
        self._show_copies(whole=True)
        if self.compute_dtype is not None:  # floating inputs in compute dtype (FSDP2's cast_forward_inputs)
            args = tuple(cast_floating(a, self.compute_dtype) for a in args)
            kwargs = {k: cast_floating(v, self.compute_dtype) for k, v in kwargs.items()}
        if self.root is not None:
            self.root.wait_gather(self.comms)
        for unit in (self.order or [])[: self.prefetch]:
            unit.start_gather(self.comms)
        out = self.module(*args, **kwargs)
        if self.root is not None and torch.is_grad_enabled():  # whole again for this output's backward
            for t in tensors_in(out):  # (another micro-batch's backward may have freed it: a pipeline)
                if t.requires_grad:
                    t.register_hook(lambda grad: self.root.wait_gather(self.comms))
        if self.order is None and torch.is_grad_enabled():
            self.order = self._recording
        elif torch.is_grad_enabled():  # backward starts with the last units: gather them now
            for unit in reversed(self.order[-self.prefetch:] if self.prefetch else []):
                unit.start_gather(self.comms)
        if not torch.is_grad_enabled():  # evaluation or generation: no backward follows
            for unit in self.units:
                unit.reshard(self.comms)
            self._show_copies(whole=False)
        return out

    def _pre_forward(self, unit: Unit, module, args) -> None:
        if self.order is None and torch.is_grad_enabled():
            self._recording.append(unit)
        unit.wait_gather(self.comms)
        if self.order is not None and unit in self.order:
            k = self.order.index(unit)
            for nxt in self.order[k + 1: k + 1 + self.prefetch]:
                nxt.start_gather(self.comms)

    def _post_forward(self, unit: Unit, module, args, output) -> None:
        unit.reshard(self.comms)
        if torch.is_grad_enabled():
            for t in tensors_in(output):  # its gradient arrives just before the unit's backward
                if t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: self._pre_backward(unit))

    def _pre_backward(self, unit: Unit) -> None:
        unit.wait_gather(self.comms)
        if self.order is not None and unit in self.order:
            k = self.order.index(unit)
            for prev in reversed(self.order[max(0, k - self.prefetch): k]):
                prev.start_gather(self.comms)

    # --- backward: reduce-scatter each unit as soon as it is done ----------------------------

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        unit = self.unit_of[p]
        unit.ready.add(p)
        if len(unit.ready) == len(unit.params):
            self._launch(unit)

    @torch.no_grad()
    def _launch(self, unit: Unit) -> None:
        packed = unit.layout.pack([p.grad for p in unit.params], self.reduce_dtype,
                                  scale=1.0 / self.dp_world_size, presence=True)
        for p in unit.params:
            p.grad = None
        row = packed.new_empty(unit.layout.grad_row_numel)
        self.pending.append((unit, self.comms.reduce_scatter(row, packed.view(-1), async_op=True),
                             row, packed))
        unit.ready.clear()
        unit.reshard(self.comms)
        if self.max_in_flight is not None and len(self.pending) > self.max_in_flight:
            self._complete(self.pending.pop(0))  # frees the oldest full-gradient buffer

    @torch.no_grad()
    def _complete(self, entry: tuple) -> None:
        unit, work, row, _ = entry
        self.comms.wait(work)
        for i, present in enumerate(unit.layout.present(row)):
            if present:  # no gradient on any rank: no .grad, as in one process
                reduce_into(self.masters[unit.params[i]], unit.layout.in_row(i, row))

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Reduce-scatter units backward left incomplete, wait for every collective, all-reduce
        the gradients of replicated parameters."""
        for unit in self.units:
            if unit.ready:  # some parameters got no gradient here
                self._launch(unit)
            elif unit.state != "free":
                unit.reshard(self.comms)
        while self.pending:
            self._complete(self.pending.pop(0))
        if self.replicated:
            layout = ShardLayout(self.replicated, 0, 1)  # one row: the whole of each parameter
            flat = layout.pack([p.grad for p in self.replicated], self.reduce_dtype,
                               scale=1.0 / self.dp_world_size, presence=True).view(-1)
            self.comms.all_reduce(flat)
            for i, (p, present) in enumerate(zip(self.replicated, layout.present(flat))):
                p.grad = None
                if not present:
                    continue
                grad = layout.in_row(i, flat).view_as(p)
                if self.masters[p] is p:  # p.grad held what earlier reductions left: replaced
                    p.grad = grad.to(torch.float32).clone()
                else:  # a separate fp32 master: this backward's reduced gradient adds up
                    reduce_into(self.masters[p], grad)
        self._show_copies(whole=False)  # backward is over: the module shows its fp32 parameters

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        sharded = [self.masters[p].grad for p in self.unit_of if self.masters[p].grad is not None]
        whole = [self.masters[p].grad for p in self.replicated if self.masters[p].grad is not None]
        return clip_sharded_grad_norm_(sharded, max_norm, self.comms, whole)

    # --- the full model: for a while, or as a state dict ---------------------------------------

    @contextlib.contextmanager
    def summon_full_params(self):
        """Every parameter whole (in compute dtype) inside the block, freed after; read-only."""
        for unit in self.units:
            unit.wait_gather(self.comms)
        self._show_copies(whole=True)
        try:
            yield self.module
        finally:
            for unit in self.units:
                unit.reshard(self.comms)
            self._show_copies(whole=False)

    @torch.no_grad()
    def state_dict(self, *args, **kwargs) -> dict:
        """The full fp32 model state, keyed like the wrapped module's (a collective)."""
        full = {}
        for p in self.names:  # keyed by the whole tensor and by the shard: either may be shown
            full[id(p)] = full[id(self.masters[p])] = gather_full(
                self.state_comms, *self.layout_of.get(p, (None, 0)), self.masters[p]).clone()
        return {name: full[id(t)] if id(t) in full else t.detach().clone()
                for name, t in self.module.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load a full state (any strategy's): keep this rank's shards."""
        for name, buf in self.module.named_buffers():
            if name in state_dict:
                buf.copy_(state_dict[name])
        for p, name in self.names.items():
            value = state_dict[name]
            layout, i = self.layout_of.get(p, (None, 0))
            self.masters[p].copy_(value if layout is None else layout.owned(i, value))
            if any(p is c for c in self.copies):
                p.copy_(value)


class Zero3(CommsStrategy):
    """The trainer's ZeRO-3: a :class:`FullyShardedDataParallel` model, the trainer's optimizer
    class and groups rebuilt over its fp32 shards."""

    name, stage = "zero3", 3

    def __init__(self, model, make_optimizer, group=None, **fsdp_kwargs):
        super().__init__(model, make_optimizer, group)
        full = self.optimizer  # over the whole parameters: its groups and hyper-parameters
        self.model = FullyShardedDataParallel(model, group, comms=self.comms, **fsdp_kwargs)
        self.comms.reset()
        self.optimizer = type(full)(regroup_params(full.param_groups, self.model.masters), **optimizer_kwargs(full))
        self.full_params = [p for g in full.param_groups for p in g["params"]]

    @property
    def pending(self) -> list:  # collectives in flight (course_lib.experiments.memory_measure)
        return self.model.pending

    def compute_parameters(self) -> list[nn.Parameter]:
        return list(self.model.names)  # the whole tensors (storage freed while their unit is)

    def stepped_tensors(self) -> dict[nn.Parameter, nn.Parameter]:
        return self.model.masters

    def state_order(self) -> list[nn.Parameter]:
        return self.full_params

    def finish_grads(self) -> None:
        self.model.finish_gradient_synchronization()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.model.clip_grad_norm_(max_norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # the fp32 shards: the module's parameters
        for p in self.model.names:  # the whole tensors (their gradients are dropped once reduced)
            p.grad = None

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(),
                "optimizer": full_optimizer_state(self.optimizer, self.full_params, self.model.layout_of,
                                                  self.model.state_comms)}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        load_full_optimizer_state(self.optimizer, state["optimizer"], self.full_params, self.model.layout_of)
