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
                         at its post-backward point: reduce-scatter its gradients (async) and
                         free parameters and gradients

so communication overlaps computation, and at most 1 + ``prefetch`` units are whole at a time
(plus the root, gathered once for forward and backward as in FSDP). The order of units is recorded
in the first forward and reversed for backward (FSDP1 fixes its order after the first iteration
in the same way; FSDP2 records it anew in every forward). Beyond ``max_in_flight``
reduce-scatters the oldest is completed and its gradient buffer freed. Per step each rank moves
3 Psi - Psi_root (paper Sec. 7.2.2).

When a unit's reduce-scatter starts is a point of backward that every rank reaches in the same
order whatever its data, the rule of FSDP2's post-backward (Zhao et al. 2023, "PyTorch FSDP",
and ``fully_shard``'s ``RegisterPostBackwardFunction`` and root final callback; restated here in
our own terms):

* a unit's **post-backward point**: autograd has the gradient with respect to the unit's
  floating-point inputs that require grad, i.e. the unit's own backward is over. ``_pre_forward``
  passes those inputs through :class:`PostBackward`, an identity whose backward is that point
  (a unit run k times in one forward: the last of its k points, counted per forward). The
  autograd engine has put every gradient of the unit's parameters into ``.grad`` by then (see
  :class:`PostBackward`), so the unit's reduce-scatter carries all of them;
* the **end of backward** (a callback queued in autograd, run when the whole backward is done):
  the units backward reached without such a point, i.e. the root and units fed no input that
  requires grad (the first block, fed token ids or the data), reduce-scatter there, in the units'
  order;
* ``finish_gradient_synchronization()``: a gradient that reached its unit after the unit's
  reduce-scatter (from an op forward made before the unit ran: the parameter used outside its
  unit, or a unit run without gradients and recomputed by reentrant checkpointing) is reduced
  here. Whether any rank holds one is agreed through one flag per unit, carried in the first
  reduce-scatter of each backward's end (alone in one small all-reduce when no unit ends a
  backward: no root), so the ranks run the same collectives.

Whether a parameter got a gradient does not decide when anything starts: a parameter with no
gradient on a rank is packed as zeros flagged absent (:mod:`course_lib.parallel.zero.sharding`),
so a branch that some ranks' data take and others' do not trains as in one process, and a
parameter no rank used gets no ``.grad`` (AdamW leaves it alone, as in one process). What must
still be alike on every rank: which units run (gathers are collectives), and whether a unit's
floating inputs require grad. A unit must not change its inputs in place (autograd refuses:
they are views made by :class:`PostBackward`, as under FSDP2; clone them first). Activation
recomputation (``torch.utils.checkpoint``, the GPT's ``set_recompute``) reruns a unit's forward
inside backward: its hooks then only make sure the unit is whole (no point registered, no free).

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
hook on the forward's output, as the other units by hooks on theirs), each post-backward point
belongs to its own forward's backward, and each backward reduce-scatters into the shards'
gradients, which add up.

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
from course_lib.parallel.zero.units import Unit, cast_floating, default_units, map_tensors, owners, tensors_in


def graph_task() -> int:
    """The id of the backward autograd is running now, -1 outside backward (what
    ``torch.utils.checkpoint`` reads to tell recomputation from forward)."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """Whether a unit's forward is called from inside backward: activation recomputation."""
    return graph_task() != -1


class PostBackward(torch.autograd.Function):
    """The identity on a unit's inputs. Its backward runs when autograd has the gradient with
    respect to all of them, i.e. when the unit's own backward is done: it calls ``hook`` there, a
    point of backward every rank reaches in the same order, whatever its data.

    Why the unit's parameters hold their gradients by then: the engine runs the ready node of the
    highest sequence number first (numbers grow in the order forward creates the nodes) and a
    parameter's AccumulateGrad before any other (sequence number UINT64_MAX). This node was made
    before the unit's computation, so every node of the unit's backward, and every AccumulateGrad
    they make ready, runs before it. A gradient reaches .grad later only from an op that forward
    made before the unit ran (the parameter used again outside its unit, or a forward run without
    gradients and recomputed in backward: reentrant checkpointing)."""

    @staticmethod
    def forward(ctx, hook, *inputs):
        ctx.hook = hook
        ctx.set_materialize_grads(False)
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3 over ``module``; mirrors torch.distributed.fsdp.FullyShardedDataParallel.

    A unit's reduce-scatter starts at a point of backward that every rank shares, whatever its
    data (FSDP2's post-backward rule, Zhao et al. 2023): its post-backward point (autograd has the
    gradient for the unit's inputs, :class:`PostBackward`), else the end of backward (the root,
    units fed no input that requires grad), and gradients that reach a unit after its
    reduce-scatter at :meth:`finish_gradient_synchronization`, agreed by flags. Never when its
    parameters' gradients happen to be there: a parameter that gets a gradient on some ranks only
    (a branch that one rank's data take) would make the ranks start it at different points, and
    the collectives would pair up wrongly (tests/test_zero3_uneven_grads.py; before this rule the
    ranks hung until the collective timeout)."""

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
        self.forward_id = 0  # numbers the forwards with gradients: whose backward a point belongs to
        self.forwards = 0  # forwards with gradients since the last finish_gradient_synchronization
        self.backward_task: int | None = None  # the backward whose end is queued (autograd's id)
        self.reached: set[Unit] = set()  # units this backward reached and did not reduce yet
        # the late-gradient flags summed over the ranks (and backwards); None until a backward's end
        # carried them (set as that reduce-scatter completes, so at finish None means none did)
        self.agreed: torch.Tensor | None = None
        for unit in self.units:
            if unit is not self.root:
                unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit),
                                                      with_kwargs=True)
                unit.module.register_forward_hook(functools.partial(self._post_forward, unit))

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
        if torch.is_grad_enabled() and not in_backward():
            self.forward_id += 1
            self.forwards += 1
        if self.root is not None:
            self.root.wait_gather(self.comms)
        for unit in (self.order or [])[: self.prefetch]:
            unit.start_gather(self.comms)
        out = self.module(*args, **kwargs)
        if self.root is not None and torch.is_grad_enabled():  # whole again for this output's backward
            for t in tensors_in(out):  # (another micro-batch's backward may have freed it: a pipeline)
                if t.requires_grad:
                    t.register_hook(lambda grad: self._root_pre_backward())
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

    def _root_pre_backward(self) -> None:
        self._backward_reached(self.root)
        self.root.wait_gather(self.comms)

    def _pre_forward(self, unit: Unit, module, args, kwargs):
        if in_backward():  # activation recomputation: the unit reruns inside its backward, whole
            unit.wait_gather(self.comms)
            return None
        if self.order is None and torch.is_grad_enabled():
            self._recording.append(unit)
        unit.wait_gather(self.comms)
        if self.order is not None and unit in self.order:
            k = self.order.index(unit)
            for nxt in self.order[k + 1: k + 1 + self.prefetch]:
                nxt.start_gather(self.comms)
        if torch.is_grad_enabled():
            return self._register_post_backward(unit, args, kwargs)
        return None

    def _register_post_backward(self, unit: Unit, args, kwargs):
        """Pass the unit's floating inputs that require grad through :class:`PostBackward`, whose
        backward is this call's post-backward point; a call without such inputs (token ids, the
        data) leaves its unit to the end of backward."""
        inputs = list({id(t): t for t in tensors_in((args, kwargs))
                       if t.is_floating_point() and t.requires_grad}.values())
        if not inputs:
            unit.unhooked.add(self.forward_id)
            return None
        fid = self.forward_id
        unit.due[fid] = unit.due.get(fid, 0) + 1
        outputs = PostBackward.apply(functools.partial(self._post_backward, unit, fid), *inputs)
        swap = {id(t): o for t, o in zip(inputs, outputs)}
        swapped = functools.partial(map_tensors, lambda t: swap.get(id(t), t))
        return swapped(args), swapped(kwargs)

    def _post_forward(self, unit: Unit, module, args, output) -> None:
        if in_backward():  # recomputation: stays whole for the backward that follows
            return
        unit.reshard(self.comms)
        if torch.is_grad_enabled():
            for t in tensors_in(output):  # its gradient arrives just before the unit's backward
                if t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: self._pre_backward(unit))

    def _pre_backward(self, unit: Unit) -> None:
        self._backward_reached(unit)
        unit.wait_gather(self.comms)
        if self.order is not None and unit in self.order:
            k = self.order.index(unit)
            for prev in reversed(self.order[max(0, k - self.prefetch): k]):
                prev.start_gather(self.comms)

    # --- backward: reduce-scatter each unit at its post-backward point ------------------------

    def _post_backward(self, unit: Unit, fid: int) -> None:
        """Autograd has the gradient with respect to one call's inputs. When it is the last call
        of that forward to get there, the unit's backward is over on every rank: reduce-scatter."""
        self._backward_reached(unit)
        if fid not in unit.due:  # finish_gradient_synchronization came between forward and backward:
            return  # its gradients are late ones, reduced at the next finish
        unit.due[fid] -= 1
        if unit.due[fid]:  # the unit ran again earlier in that forward: its backward is still to come
            return
        del unit.due[fid]
        if fid not in unit.unhooked:  # else a call of it has no such point: at the end of backward
            self.reached.discard(unit)
            self._launch(unit)

    def _backward_reached(self, unit: Unit) -> None:
        """Note that this backward reached ``unit``; queue :meth:`_end_of_backward` once per backward
        (FSDP2's final callback: autograd runs it when the whole backward is done)."""
        self.reached.add(unit)
        task = graph_task()
        if task != self.backward_task:
            self.backward_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    @torch.no_grad()
    def _end_of_backward(self) -> None:
        """The last point of a backward, the same on every rank: reduce-scatter the units it reached
        and left whole (the root, units fed no input that requires grad: no post-backward point of
        their own). The first of them carries one flag per unit: this rank holds a gradient that
        reached its unit after its reduce-scatter (a late one), reduced at finish."""
        self.backward_task = None
        ending = [u for u in self.units if u in self.reached]  # in the units' order on every rank
        self.reached.clear()
        late = torch.tensor([u not in ending and any(p.grad is not None for p in u.params)
                             for u in self.units], dtype=self.reduce_dtype)
        for i, unit in enumerate(ending):
            self._launch(unit, late if i == 0 else None)

    @torch.no_grad()
    def _launch(self, unit: Unit, flags: torch.Tensor | None = None) -> None:
        """Reduce-scatter whatever gradients the unit's parameters hold (with presence flags:
        none here is a zero that says so), drop them, free the unit. ``flags``: one more column
        per unit, carried to every rank (finish_gradient_synchronization's late gradients)."""
        packed = unit.layout.pack([p.grad for p in unit.params], self.reduce_dtype,
                                  scale=1.0 / self.dp_world_size, presence=True)
        if flags is not None:
            packed = torch.cat([packed, flags.to(packed.dtype).expand(packed.shape[0], -1)], dim=1)
        for p in unit.params:
            p.grad = None
        row = packed.new_empty(packed.shape[1])
        self.pending.append((unit, self.comms.reduce_scatter(row, packed.view(-1), async_op=True),
                             row, packed))
        unit.reshard(self.comms)
        if self.max_in_flight is not None and len(self.pending) > self.max_in_flight:
            self._complete(self.pending.pop(0))  # frees the oldest full-gradient buffer

    @torch.no_grad()
    def _complete(self, entry: tuple) -> None:
        unit, work, row, _ = entry
        self.comms.wait(work)
        width = unit.layout.grad_row_numel
        if row.numel() > width:  # it carried the late-gradient flags of a backward
            flags = row[width:]
            self.agreed = flags.clone() if self.agreed is None else self.agreed + flags
        for i, present in enumerate(unit.layout.present(row[:width])):
            if present:  # no gradient on any rank: no .grad, as in one process
                reduce_into(self.masters[unit.params[i]], unit.layout.in_row(i, row))

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce-scatter; reduce-scatter the units that got a gradient after their
        own on some rank (the flags every backward's end carried say which, the same on every
        rank); all-reduce the gradients of replicated parameters."""
        while self.pending:
            self._complete(self.pending.pop(0))
        if self.agreed is None and self.forwards:  # no backward's end carried the flags (no root): alone
            self.agreed = torch.tensor([any(p.grad is not None for p in u.params) for u in self.units],
                                       dtype=self.reduce_dtype)
            self.comms.all_reduce(self.agreed)
        for unit, flag in zip(self.units, [] if self.agreed is None else self.agreed.tolist()):
            if flag > 0:
                self._launch(unit)
        for unit in self.units:
            unit.due.clear()
            unit.unhooked.clear()
            if unit.state != "free":
                unit.reshard(self.comms)
        self.reached.clear()
        self.forwards, self.agreed = 0, None
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
