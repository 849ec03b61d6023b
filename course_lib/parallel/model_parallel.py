"""Every parallelism at once: the Strategy that trains a :class:`~course_lib.parallel.gpt_parallel.GPTStage`
on the dp x pp x cp x tp grid (the "4D parallelism" of Megatron-LM and picotron).

It is built by :func:`course_lib.parallel.parallelize.parallelize`, which applies tp/sp, pp, cp
and then dp/ZeRO in one documented order. One training step, on every rank::

    x, y (accum, B, T): this dp rank's samples   -> this cp rank's chunks (accum, B, T/cp)
    forward_backward (Pipeline.train_step): the accum micro-batches through the pp stages (AFAB or 1F1B);
        every tp/sp/cp collective happens inside the stage's forward and backward
    finish_grads: the data-parallel strategy (ddp, zero1, zero2, zero3) averages the gradients over
        the dp x cp group (cp ranks saw different tokens of the same samples); with ep > 1 the
        experts apart, over their edp x cp group (parallel.expert.layer.sync_expert_grads); then
        the tied embedding's gradient is summed between the first and last stage, and under
        sequence parallelism the replicated parameters' gradients are summed over tp
    clip_grad_norm_: the norm of the whole model's gradient (each element counted once)
    step: the data-parallel strategy's optimizer step

The gradient each optimizer sees is therefore the full model's gradient of the mean loss over the
global batch: training equals one process (checked in tests/test_parallel_4d.py).

Checkpoints: ``state_dict()`` gathers the tp shards (all-gather over tp) and the stages (over pp)
into the ONE full format of :class:`~course_lib.parallel.strategy.Strategy` (a GPT state dict and
the optimizer state of the trainer's optimizer over the whole GPT); ``load_state_dict`` takes it
apart again, so a run saved under tp=2, pp=2 resumes under single or ddp and the reverse.

Figures: ``comms`` maps each group to its :class:`~course_lib.parallel.comms.Comms`; "dp" counts
the gradient traffic of the dp x cp group, "tp" the Megatron all-reduces, "sp" the
sequence-parallel all-gathers / reduce-scatters, "cp" the ring, "pp" activations and the tied grad.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from course_lib.gpt.model import GPT
from course_lib.parallel.comms import Comms
from course_lib.parallel.context.ring_attention import cp_split
from course_lib.parallel.expert.layer import ep_shard, ep_unshard, is_expert, sync_expert_grads
from course_lib.parallel.footprint import measure_model_states, peak
from course_lib.parallel.gpt_parallel import GPTStage, shard_named, shard_spec, unshard_named
from course_lib.parallel.pipeline.comms import exchange_tied_grad
from course_lib.parallel.pipeline.schedules import Pipeline
from course_lib.parallel.process_groups import ProcessGroupGrid
from course_lib.parallel.step import Precision, no_phase
from course_lib.parallel.strategy import Strategy


class ModelParallel(Strategy):
    name = "model_parallel"

    def __init__(self, stage: GPTStage, pipeline: Pipeline, inner: Strategy, grid: ProcessGroupGrid,
                 comms: dict[str, Comms], make_optimizer):
        """Built by :func:`course_lib.parallel.parallelize.parallelize` (which applies the
        parallelisms in order): ``stage`` this rank's part of the GPT, ``pipeline`` its schedule,
        ``inner`` the data-parallel strategy wrapping the stage over the dp x cp group, ``comms``
        the "tp", "sp", "cp" and "pp" groups' counters; ``make_optimizer`` builds the trainer's
        optimizer (for the full checkpoint format)."""
        self.grid, self.cfg, self.make_optimizer = grid, stage.config, make_optimizer
        self.comms, self.inner, self.pipeline = comms, inner, pipeline
        self.comms["dp"] = getattr(inner, "comms", Comms(grid.dp_cp_group))
        self.module, self.model, self.optimizer = stage, inner.model, inner.optimizer
        # the whole tensors forward computes with, by name (ZeRO-3's stage shows its shards between
        # uses; compute_parameters() are in the order of named_parameters())
        self.names = dict(zip(inner.compute_parameters(), (n for n, _ in stage.named_parameters())))
        self.group, self.dp_rank, self.dp_world_size = grid.dp_cp_group, grid.dp_rank, grid.dp_world_size
        # ZeRO-1/2: gradients live on the optimizer's fp32 shards; ZeRO-3: on the module's fp32 masters
        self.shards = inner.stepped_tensors()
        # the parameters ZeRO shards over dp x cp: those in its layout (ZeRO-1/2: the optimizer's,
        # ZeRO-3: the module's); the others (DDP's, ZeRO-3's replicate=, experts, frozen) stay whole
        layouts = getattr(inner.optimizer, "layout_of", None) or getattr(inner.model, "layout_of", None) or {}
        self.dp_sharded = {id(p) for p in layouts}
        self._states_after_backward = None
        self.last_stats, self.last_micro = None, 0  # the last step's PipelineStats (bubble) and m

    # --- the step ----------------------------------------------------------------------------
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, precision: Precision | None = None,
                         phase=no_phase) -> torch.Tensor:
        """Forward and backward of (accum, B, T) samples, the pipeline scheduling the micro-batches
        (the pipeline does not scale the loss for fp16); returns the step's mean loss (this dp
        rank's samples, this cp rank's tokens). Call ``finish_grads`` after it."""
        with precision.autocast if precision is not None else nullcontext():
            return self._pipeline_step(x, y)

    def _pipeline_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        accum, B, T = x.shape
        g = self.grid
        x, y = (cp_split(t.reshape(accum * B, T), g.cp_rank, g.cp_world_size) for t in (x, y))
        loss, self.last_stats = self.pipeline.train_step(x, y, accum, no_sync=self.inner.no_sync, model=self.model,
                                                         params=self.names)
        self.last_micro = accum
        self._states_after_backward = measure_model_states(self)  # full gradients, before any reduce-scatter
        # a Python float from the pipeline: keep its digits; on the device, for the trainer's all-reduce
        return torch.tensor(loss, dtype=torch.float64, device=x.device)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        g = self.grid
        x, y = (cp_split(t, g.cp_rank, g.cp_world_size) for t in (x, y))
        return self.pipeline.eval_loss(x, y, model=self.model)

    def no_sync(self):
        return self.inner.no_sync()

    def _grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The gradient the optimizer will use: p's, or its ZeRO shard's."""
        return self.shards.get(p, p).grad  # experts are not sharded

    @torch.no_grad()
    def finish_grads(self) -> None:
        self.inner.finish_grads()
        stage = self.module
        if self.grid.ep_world_size > 1:
            sync_expert_grads(stage, self.comms["edp"], self.grid.dp_world_size * self.grid.cp_world_size)
        if stage.tied is not None and stage.tied.requires_grad:  # first <-> last stage: both get the sum
            mine = self._grad(stage.tied)
            other = 0 if stage.is_last else self.grid.pp_world_size - 1
            mine.add_(exchange_tied_grad(self.comms["pp"], mine, other))
        partial = [self._grad(p) for p, n in self.names.items() if stage.sp_partial(n)]
        partial = [t for t in partial if t is not None and t.numel()]
        if partial:  # one message for all of them
            flat = torch.cat([t.reshape(-1) for t in partial])
            self.comms["sp"].all_reduce(flat)
            torch._foreach_copy_(partial, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in partial]), partial)])

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the full model's gradient. Each rank adds its squares weighted by
        1 / (number of ranks holding the same numbers): replicas over dp x cp (unless ZeRO shards
        that tensor: ZeRO-3's ``replicate=`` parameters stay whole on every dp x cp rank), over tp
        (unsplit tensors), and the last stage's copy of the tied weight (0)."""
        dp_copies = self.grid.dp_world_size * self.grid.cp_world_size
        ep_sharded = self.grid.ep_world_size > 1  # experts: copies over edp x cp only
        expert_copies = self.grid.edp_world_size * self.grid.cp_world_size
        p0 = next(self.module.parameters())
        sq = torch.zeros((), dtype=torch.promote_types(p0.dtype, torch.float32), device=p0.device)
        grads = []
        for p, n in self.names.items():
            g = self._grad(p)
            if g is None:
                continue
            grads.append(g)
            if ep_sharded and is_expert(n):
                copies = expert_copies
            else:
                copies = 1 if id(p) in self.dp_sharded else dp_copies
            copies *= 1 if shard_spec(n) else self.grid.tp_world_size
            if p is self.module.tied and self.module.is_last:
                continue
            sq += g.to(sq.dtype).pow(2).sum() / copies
        dist.all_reduce(sq)  # every rank of the world
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s rule
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def step(self) -> None:
        self.inner.step()

    def figures(self) -> dict:
        """This rank's per-step figures since the last call: bytes sent per group (tp, sp, cp, pp,
        dp), the most model states it held (parameters, gradients, optimizer states: after backward
        and now, so call it between step and zero_grad), the peak activation bytes and the pipeline bubble measured
        on the schedule's clock next to (p - 1) / (m + p - 1)."""
        out = {f"sent_bytes_{k}": c.sent_bytes for k, c in self.comms.items()}
        for c in self.comms.values():
            sec = c.seconds
            c.reset()
            c.seconds = sec  # comm_s keeps running; only the byte counts restart
        now = measure_model_states(self)
        states = peak(self._states_after_backward, now) if self._states_after_backward else now
        out["model_state_bytes"] = states.params + states.grads + states.optimizer
        st = self.last_stats
        if st is not None:
            p, m = self.grid.pp_world_size, self.last_micro
            out.update(peak_activation_bytes=st.peak_activation_bytes, bubble=st.bubble,
                       bubble_theory=(p - 1) / (m + p - 1))
        return out

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.comms.values())

    @comm_s.setter
    def comm_s(self, value: float) -> None:
        for c in self.comms.values():
            c.seconds = 0.0
        self.comms["dp"].seconds = value

    def comm_bytes(self) -> float:
        return sum(c.volume_bytes for c in self.comms.values())

    # --- the one full checkpoint format --------------------------------------------------------
    def _full_layout(self) -> tuple[list[list[str]], list[str]]:
        """The full GPT's parameter names in the groups of the trainer's optimizer over it, and
        its state-dict keys: from a weightless (meta-device) twin."""
        with torch.device("meta"):
            ref = GPT(self.cfg)
        for n, p in ref.named_parameters():
            p.requires_grad_(n not in self.module.frozen)  # the trainer's optimizer skips frozen ones
        name_of = {id(p): n for n, p in ref.named_parameters()}
        groups = [[name_of[id(p)] for p in g["params"]] for g in self.make_optimizer(ref).param_groups]
        return groups, list(ref.state_dict())

    def state_dict(self) -> dict:
        """Full model and optimizer state, identical on every rank (a collective on all ranks)."""
        inner = self.inner.state_dict()  # full over dp x cp, this rank's tp shard of its stage
        order = [self.names[p] for g in self._inner_groups() for p in g]
        model_part = {k: self._gather_tp(k, v) for k, v in inner["model"].items()}
        opt_part = {order[int(i)]: {k: self._gather_tp(order[int(i)], v) if v.dim() else v.clone()
                                    for k, v in st.items()} for i, st in inner["optimizer"]["state"].items()}
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in inner["optimizer"]["param_groups"]]
        stages = [None] * self.grid.pp_world_size
        dist.all_gather_object(stages, (model_part, opt_part), group=self.grid.pp_group)
        model_sd, opt_by_name = {}, {}
        for m, o in reversed(stages):  # the first stage last: its wte wins over lm_head's copy
            model_sd.update(m)
            opt_by_name.update(o)
        model_sd["lm_head.weight"] = model_sd["transformer.wte.weight"]
        full_groups, keys = self._full_layout()
        full_order = [n for g in full_groups for n in g]
        starts = [sum(len(g) for g in full_groups[:i]) for i in range(len(full_groups))]
        groups = [{**h, "params": list(range(s, s + len(g)))} for h, s, g in zip(hyper, starts, full_groups)]
        state = {i: opt_by_name[n] for i, n in enumerate(full_order) if n in opt_by_name}
        ordered = {k: model_sd[k] for k in keys}
        return {"model": ordered, "optimizer": {"state": state, "param_groups": groups}}

    def _gather_tp(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The full tensor ``name`` from this rank's piece (an all-gather over tp if it is split,
        over ep if it holds this rank's experts)."""
        pieces = [t]
        if shard_spec(name) is not None and self.grid.tp_world_size > 1:
            pieces = [torch.empty_like(t) for _ in range(self.grid.tp_world_size)]
            dist.all_gather(pieces, t.contiguous(), group=self.grid.tp_group)
        full = unshard_named(name, pieces, self.cfg.vocab_size)
        if is_expert(name) and self.grid.ep_world_size > 1:
            pieces = [torch.empty_like(full) for _ in range(self.grid.ep_world_size)]
            dist.all_gather(pieces, full.contiguous(), group=self.grid.ep_group)
            full = ep_unshard(name, pieces)
        return full.clone()

    def _inner_groups(self) -> list[list[nn.Parameter]]:
        """The stage's parameters in the groups (and order) of the dp strategy's optimizer state."""
        opt, full = self.inner.optimizer, self.inner.state_order()
        # ZeRO's groups hold fp32 shards of these, one per parameter: the same groups, in order
        sizes = [len(g["params"]) for g in opt.param_groups]
        return [full[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(sizes))]

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        stage, g = self.module, self.grid
        full_order = [n for grp in self._full_layout()[0] for n in grp]
        saved = sum(len(grp["params"]) for grp in state["optimizer"]["param_groups"])
        if saved != len(full_order):  # its states would go to other parameters (a crash in a collective later)
            raise ValueError(f"the state's optimizer holds {saved} parameters, this model trains {len(full_order)}: "
                             "was it saved with other parameters frozen (requires_grad=False)? Freeze the same ones")
        v = self.cfg.vocab_size
        model = {k: ep_shard(k, shard_named(k, state["model"][k], g.tp_rank, g.tp_world_size, v), g.ep_rank,
                             g.ep_world_size) for k in stage.state_dict()}
        index = {n: i for i, n in enumerate(full_order)}
        order = [self.names[p] for grp in self._inner_groups() for p in grp]
        opt_state = {}
        for j, n in enumerate(order):
            st = state["optimizer"]["state"].get(index["transformer.wte.weight" if n == "lm_head.weight" else n])
            if st is not None:
                opt_state[j] = {k: (ep_shard(n, shard_named(n, t, g.tp_rank, g.tp_world_size, v), g.ep_rank,
                                             g.ep_world_size) if t.dim() else t).clone()
                                if torch.is_tensor(t) else t for k, t in st.items()}  # no alias of the caller's
        sizes = [len(grp) for grp in self._inner_groups()]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        groups = [{**{k: v for k, v in h.items() if k != "params"}, "params": list(range(s, s + n))}
                  for h, s, n in zip(state["optimizer"]["param_groups"], starts, sizes)]
        self.inner.load_state_dict({"model": model, "optimizer": {"state": opt_state, "param_groups": groups}})
