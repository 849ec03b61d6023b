"""Pipeline parallelism: consecutive layers on consecutive ranks, micro-batches flowing through.

Rank ``pp_rank`` holds stage ``pp_rank`` of ``pp_world_size``: a contiguous slice of the layers
(the first stage also the embeddings, the last also the head and the loss). A batch is cut into
m micro-batches; a stage sends its output activations to the next stage and, in backward, the
gradient of its input to the previous one (point-to-point send/recv).

Two schedules (``schedule=``):

* ``"afab"`` (all forward, all backward; GPipe, Huang et al. 2019): m forwards, then m backwards.
  Every stage keeps the activations of all m micro-batches.
* ``"1f1b"`` (one forward, one backward; PipeDream-Flush, Narayanan et al. 2021, Megatron-LM):
  stage r runs p - r - 1 warm-up forwards, then alternates one forward and one backward, then
  drains. Same bubble, but at most p - r micro-batches in flight, so activation memory is bounded
  by p instead of m.

Both idle for a "bubble" of (p - 1) forward+backward times per step, a fraction
(p - 1) / (m + p - 1) of it (GPipe, Sec. 2.3; Narayanan et al. 2021, Sec. 2.2.1, give the same bubble
as (p - 1) / m of the ideal time). The pipeline
measures it two ways: on a logical clock (each forward costs 1 tick and each backward 2, every
message carries the tick at which it was produced and a stage starts an operation when both it
and its input are ready: the schedule's own timing, free of this machine's noise), and in wall
time (seconds computing vs seconds per step; waits include the OS scheduling the processes).

Tied weights across stages (GPT's wte on the first stage, lm_head on the last): each stage keeps
a copy; after backward the two gradients are exchanged and summed, as Megatron-LM does with its
embedding group, so both copies stay equal (only this step's gradients are exchanged, so steps
accumulated without zero_grad count each once; a frozen tied weight is frozen on both stages). The
messages are in :mod:`course_lib.parallel.pipeline.comms`.

Dropout: each stage draws its masks from its own random stream, micro-batch by micro-batch, so
with dropout > 0 the masks are not one process's (the model-parallel GPTStage refuses dropout);
the equality with one process holds for dropout = 0.

A loss term computed on a stage that is not the last (a mixture of experts' load-balancing loss,
:mod:`course_lib.gpt.moe`): a stage with ``has_extra_loss`` True and an ``extra_loss()`` method (a scalar of its last
forward) has it added, / m, to the step's loss and to each micro-batch's backward; the stages' losses
are then summed over the pipeline (an all-reduce) instead of broadcast from the last one.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.parallel.comms import Comms
from course_lib.parallel.pipeline.comms import exchange_tied_grad, recv_activation, send_activation

SCHEDULES = ("afab", "1f1b")
FORWARD_TICKS, BACKWARD_TICKS = 1, 2  # backward ~ twice the forward's FLOPs


def split_layers(n_layer: int, pp_world_size: int) -> list[range]:
    """Layers of each stage, as even as possible (the first stages get the extra ones)."""
    if n_layer < pp_world_size:
        raise ValueError(f"cannot split {n_layer} layers into pp_world_size={pp_world_size} "
                         "stages: use at most as many stages as layers")
    base, extra = divmod(n_layer, pp_world_size)
    sizes = [base + (r < extra) for r in range(pp_world_size)]
    starts = [sum(sizes[:r]) for r in range(pp_world_size)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


def schedule_ops(schedule: str, n_micro: int, pp_rank: int, pp_world_size: int) -> list[tuple[str, int]]:
    """The order in which stage ``pp_rank`` runs ("F", i) and ("B", i) for micro-batches i."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "afab":
        return [("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)]
    warmup = min(pp_world_size - pp_rank - 1, n_micro)
    ops = [("F", i) for i in range(warmup)]
    for i in range(n_micro - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", i) for i in range(n_micro - warmup, n_micro)]


class PipelineStage(nn.Module):
    """first (stage 0 only) -> layers -> last (last stage only: returns the loss)."""

    def __init__(self, layers: list[nn.Module], first: nn.Module | None, last: nn.Module | None,
                 activation_shape, names: dict[str, nn.Parameter], tied: nn.Parameter | None = None):
        super().__init__()
        self.first, self.layers, self.last = first, nn.ModuleList(layers), last
        self.activation_shape = activation_shape  # micro-batch input -> shape between stages
        self.names = names  # this stage's parameters under their names in the whole model
        self.tied = tied  # the copy of a weight shared with another stage, if any

    def forward(self, x, targets=None):
        if self.first is not None:
            x = self.first(x)
        for layer in self.layers:
            x = layer(x)
        return self.last(x, targets) if self.last is not None else x


class _GPTEmbed(nn.Module):
    def __init__(self, tr: nn.ModuleDict):
        super().__init__()
        self.wte, self.wpe, self.drop = tr.wte, tr.wpe, tr.drop

    def forward(self, idx):  # (B, T) -> (B, T, C)
        return self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))


class _GPTHead(nn.Module):
    def __init__(self, ln_f: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x, targets):  # (B, T, C) -> mean cross-entropy
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def gpt_stage(model: nn.Module, pp_rank: int, pp_world_size: int) -> PipelineStage:
    """Stage ``pp_rank`` of a course_lib.gpt.model.GPT; the last stage gets its own copy of the tied
    embedding as its LM head (unless there is only one stage), frozen if the embedding is. With
    ``dropout`` > 0 the masks differ from one process's (module docstring)."""
    tr, cfg = model.transformer, model.config
    blocks = [tr.h[i] for i in split_layers(cfg.n_layer, pp_world_size)[pp_rank]]
    first = _GPTEmbed(tr) if pp_rank == 0 else None
    last = tied = None
    if pp_rank == pp_world_size - 1:
        lm_head = model.lm_head
        if pp_world_size > 1:
            lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            # frozen if the embedding is: in one process they are one tensor
            lm_head.weight = tied = nn.Parameter(model.lm_head.weight.detach().clone(),
                                                 requires_grad=model.lm_head.weight.requires_grad)
        last = _GPTHead(tr.ln_f, lm_head)
    if pp_rank == 0 and pp_world_size > 1:
        tied = tr.wte.weight
    parts = [m for m in (first, *blocks, last) if m is not None]
    own = {id(p) for m in parts for p in m.parameters()}
    names = {n: p for n, p in model.named_parameters(remove_duplicate=False) if id(p) in own}
    if tied is not None and pp_rank > 0:
        names["lm_head.weight"] = tied
    return PipelineStage(blocks, first, last, lambda idx: (*idx.shape, cfg.n_embd), names, tied)


class _MLPHead(nn.Module):
    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, x, targets):
        return F.cross_entropy(self.head(x), targets)


def mlp_stage(model: nn.Module, pp_rank: int, pp_world_size: int) -> PipelineStage:
    """Stage ``pp_rank`` of a course_lib.parallel.toy.ToyMLP (Linear + GELU layers, then a head)."""
    layers = [nn.Sequential(model.layers[i], nn.GELU())
              for i in split_layers(len(model.layers), pp_world_size)[pp_rank]]
    last = _MLPHead(model.head) if pp_rank == pp_world_size - 1 else None
    own = {id(p) for m in layers + [last] if m is not None for p in m.parameters()}
    names = {n: p for n, p in model.named_parameters() if id(p) in own}
    width = model.head.in_features
    return PipelineStage(layers, None, last, lambda x: (x.shape[0], width), names)


@dataclass
class PipelineStats:
    busy_ticks: int  # this stage's forward + backward ticks
    total_ticks: float  # the step's length on the logical clock (all stages)
    busy_s: float  # wall seconds spent computing
    step_s: float  # wall seconds of the whole step
    peak_in_flight: int  # most micro-batches whose activations were held at once
    peak_activation_bytes: int = 0  # most bytes autograd held for backward at once (parameters excluded)

    @property
    def bubble(self) -> float:
        """Idle fraction on the logical clock: compare with (p - 1) / (m + p - 1)."""
        return 1 - self.busy_ticks / self.total_ticks

    @property
    def bubble_wall(self) -> float:
        return 1 - self.busy_s / self.step_s


@contextlib.contextmanager
def _count_saved(param_storages: set[int]):
    """Bytes of the tensors autograd saves for backward inside the block, each storage once,
    parameters excluded (as :func:`course_lib.experiments.memory_measure.saved_activation_bytes`).
    ``param_storages``: the parameters' storages by identity (``_cdata``), which a ZeRO-3 gather
    keeps while it re-allocates their bytes."""
    seen, counted = set(), {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in param_storages and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            counted["bytes"] += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counted


class Pipeline:
    """Runs training steps of one stage; every rank of the pipeline group calls ``train_step``."""

    def __init__(self, stage: nn.Module, comms: Comms, schedule: str = "1f1b", sum_tied: bool = True):
        """``stage``: a :class:`PipelineStage` or any module with its ``forward(x, targets)``,
        ``activation_shape`` and ``tied``. ``sum_tied=False`` leaves the tied weight's gradient
        exchange to the caller (done after a data-parallel reduction that would overwrite it)."""
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.stage, self.comms, self.schedule, self.sum_tied = stage, comms, schedule, sum_tied
        self.pp_rank, self.pp_world_size = comms.rank, comms.world_size
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == self.pp_world_size - 1
        self.dtype = next(stage.parameters()).dtype
        self.device = next(stage.parameters()).device  # NCCL sends CUDA tensors only
        self.loss_dtype = torch.promote_types(self.dtype, torch.float32)  # fp32, or fp64 for fp64 models

    def train_step(self, x: torch.Tensor, targets: torch.Tensor, n_micro: int, no_sync=None, model=None,
                   params=None):
        """Forward and backward of one batch (gradients accumulate in the stage's parameters).
        Returns the batch's mean loss (on every rank) and this rank's :class:`PipelineStats`.
        ``no_sync``: a context manager factory (a data-parallel wrapper's) entered for every
        backward but the last micro-batch's, which is the last backward of both schedules.
        ``model``: what each forward calls (a data-parallel wrapper of the stage, e.g. ZeRO-3's,
        which gathers its shards); default the stage. ``params``: the tensors it computes with (not
        counted as activations); default the stage's parameters."""
        model = self.stage if model is None else model
        if x.shape[0] % n_micro:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by n_micro={n_micro}")
        xs, ys = x.chunk(n_micro), targets.chunk(n_micro)
        extra_loss = getattr(self.stage, "has_extra_loss", False) and self.pp_world_size > 1
        t_step, busy_s, clock, busy = time.perf_counter(), 0.0, 0.0, 0
        self.sends, saved, in_flight, peak, held, peak_bytes, micro_bytes = [], {}, 0, 0, 0, 0, {}
        params = {p.untyped_storage()._cdata for p in (self.stage.parameters() if params is None else params)}
        loss_sum = torch.zeros((), dtype=self.loss_dtype, device=self.device)
        # gradients accumulated by earlier steps (no zero_grad between them): the tied copies
        # already hold their sum, so only this step's part is exchanged
        tied = self.stage.tied if self.sum_tied else None
        tied_before = tied.grad.clone() if tied is not None and tied.grad is not None else None
        for op, i in schedule_ops(self.schedule, n_micro, self.pp_rank, self.pp_world_size):
            if op == "F":
                ready = 0.0
                if self.is_first:
                    inp = xs[i]
                else:
                    inp, ready = recv_activation(self.comms, self.stage.activation_shape(xs[i]), self.dtype,
                                                 self.device, self.pp_rank - 1)
                    inp.requires_grad_()
                t0 = time.perf_counter()
                with _count_saved(params) as counted:
                    out = model(inp, ys[i] if self.is_last else None)
                    extra = self.stage.extra_loss() if extra_loss and not self.is_last else 0.0
                if torch.is_tensor(extra):  # a loss term of this (not last) stage: / m as the loss
                    extra = extra / n_micro
                    loss_sum += extra.detach().to(loss_sum.dtype)
                micro_bytes[i] = counted["bytes"]
                held += micro_bytes[i]
                peak_bytes = max(peak_bytes, held)
                if self.is_last:
                    out = out / n_micro  # the batch loss is the mean over micro-batches
                    loss_sum += out.detach()
                busy_s += time.perf_counter() - t0
                clock, busy = max(clock, ready) + FORWARD_TICKS, busy + FORWARD_TICKS
                if not self.is_last:
                    self.sends += send_activation(self.comms, out.detach(), clock, self.pp_rank + 1)
                saved[i] = (inp, out, extra)
                in_flight += 1
                peak = max(peak, in_flight)
            else:
                inp, out, extra = saved.pop(i)
                ready, grad = 0.0, None
                if not self.is_last:
                    grad, ready = recv_activation(self.comms, out.shape, self.dtype, self.device, self.pp_rank + 1)
                t0 = time.perf_counter()
                with no_sync() if no_sync is not None and i < n_micro - 1 else contextlib.nullcontext():
                    if torch.is_tensor(extra):
                        torch.autograd.backward([out, extra], [grad, None])
                    elif out.requires_grad:  # False: the first stage's parameters are all frozen
                        out.backward(grad)
                busy_s += time.perf_counter() - t0
                clock, busy = max(clock, ready) + BACKWARD_TICKS, busy + BACKWARD_TICKS
                if not self.is_first:
                    self.sends += send_activation(self.comms, inp.grad, clock, self.pp_rank - 1)
                in_flight -= 1
                held -= micro_bytes.pop(i)
        for work in self.sends:
            self.comms.wait(work)
        if self.sum_tied:
            self._sum_tied_grads(tied_before)
        total = torch.tensor([clock], dtype=torch.float64, device=self.device)
        self.comms.all_reduce(total, op=torch.distributed.ReduceOp.MAX)  # the step's makespan
        if extra_loss:  # every stage holds a part of the loss
            self.comms.all_reduce(loss_sum)
        else:
            self.comms.broadcast(loss_sum, src=self.pp_world_size - 1)
        stats = PipelineStats(busy, total.item(), busy_s, time.perf_counter() - t_step, peak, peak_bytes)
        return loss_sum.item(), stats

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, targets: torch.Tensor, model=None) -> torch.Tensor:
        """Forward only, the whole batch at once (evaluation): its loss, on every rank. ``model``:
        as in :meth:`train_step`."""
        model = self.stage if model is None else model
        loss = torch.zeros((), dtype=self.loss_dtype, device=self.device)
        inp = x if self.is_first else recv_activation(self.comms, self.stage.activation_shape(x), self.dtype,
                                                      self.device, self.pp_rank - 1)[0]
        out = model(inp, targets if self.is_last else None)
        if self.is_last:
            loss += out.to(self.loss_dtype)
        else:
            for work in send_activation(self.comms, out, 0.0, self.pp_rank + 1):
                self.comms.wait(work)
        self.comms.broadcast(loss, src=self.pp_world_size - 1)
        return loss

    @torch.no_grad()
    def _sum_tied_grads(self, before: torch.Tensor | None = None) -> None:
        """First and last stage hold copies of one weight: both get the sum of their gradients.
        ``before``: the (already summed, equal) gradient the copies held before this step.
        A frozen tied weight is frozen on both stages (gpt_stage): neither gets a gradient."""
        w = self.stage.tied
        if w is None or not w.requires_grad:
            return
        other = 0 if self.is_last else self.pp_world_size - 1
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        mine = w.grad - before if before is not None else w.grad.clone()  # this step's part
        w.grad = w.grad + exchange_tied_grad(self.comms, mine, other)
