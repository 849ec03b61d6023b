"""The one training step: what the trainer, every experiment and every lesson run.

    result = train_step(strategy, x, y, grad_clip=1.0)   # x, y: (accum, B, T) this rank's micro-batches

For any :class:`~course_lib.parallel.strategy.Strategy`, one optimizer step on one global batch:

    forward_backward   strategy.forward_backward: for a data-parallel strategy (the default,
                       :func:`accumulate`) each micro-batch's loss / accum goes backward, under
                       ``no_sync`` except the last one, so gradients are communicated once;
                       model parallelism overrides it with its pipeline schedule
    finish_grads       wait for (or do) the gradient communication
    clip_grad_norm     the norm of the gradient over all ranks (clipped if ``grad_clip`` > 0)
    optimizer_step     strategy.step(); fp16: unscale, skip on inf/NaN, adjust the loss scale
    zero_grad

This is nanoGPT's step (Karpathy, github.com/karpathy/nanoGPT, train.py, 2022-2023) with PyTorch's
GradScaler rule for fp16 ("Automatic Mixed Precision", torch.amp docs: skip the step on inf/NaN
gradients and back off the scale, grow it after ``growth_interval`` good steps).

fp16 under data parallelism equals one process while no step overflows, and may skip other steps
when one does: each of dp ranks averages the loss over its own rows, so its scaled backward
carries activation gradients dp times larger than one process's, and at the same loss scale it
overflows (and skips) earlier. One process over the same per-rank micro-batches skips where the
ranks do; PyTorch's DDP behaves the same. (A review measured this in 2026: 9 strategies, 2
ranks, initial scale 2^24: the ranks skipped steps 0-4, one process 0-3 and 7.)

Phases: ``phase(name, micro)`` returns a context manager entered around each phase (``micro``: the
micro-batch index for "forward" and "backward", else None). The trainer times compute with it,
the profiler labels the phases, a lesson measures memory between them; :func:`forward_backward`
and :func:`optimizer_step` are the two halves a lesson can run in separate cells.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

Phase = Callable[[str, "int | None"], AbstractContextManager]


def no_phase(name: str, micro: int | None) -> AbstractContextManager:
    return nullcontext()


@dataclass
class Precision:
    """Autocast for bf16/fp16 (none for fp32) and the loss scaler (enabled for fp16 only)."""
    autocast: AbstractContextManager = field(default_factory=nullcontext)
    scaler: torch.amp.GradScaler = field(default_factory=lambda: torch.amp.GradScaler("cpu", enabled=False))
    good_steps: int = 0  # consecutive finite fp16 steps (for the scale's growth)
    skipped: int = 0  # fp16 steps skipped so far because their gradients overflowed

    @classmethod
    def for_dtype(cls, device_type: str, dtype: str) -> Precision:
        autocast = (nullcontext() if dtype == "float32"
                    else torch.autocast(device_type, dtype=getattr(torch, dtype)))
        return cls(autocast, torch.amp.GradScaler(device_type, enabled=dtype == "float16"))


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's mean loss over its micro-batches (a device tensor: no host sync)
    grad_norm: torch.Tensor | None  # the global gradient norm before clipping (None: not computed)


def accumulate(strategy, x: torch.Tensor, y: torch.Tensor, precision: Precision,
               phase: Phase = no_phase) -> torch.Tensor:
    """Forward and backward of the micro-batches x[i], y[i] (accum, B, T); gradients synchronised
    on the last one only. Returns the sum of the micro-batches' loss / accum (detached)."""
    accum, loss_sum = x.shape[0], None
    for micro in range(accum):
        with nullcontext() if micro == accum - 1 else strategy.no_sync():
            with phase("forward", micro), precision.autocast:
                # the logits (B, T, V) are not kept: backward needs only the loss's graph, and
                # holding them through backward adds B T V values to the step's peak
                # (course_lib.analysis.memory.step_peak)
                loss = strategy.model(x[micro], y[micro])[1]
            loss = loss / accum  # the mean over the micro-batches
            with phase("backward", micro):
                precision.scaler.scale(loss).backward()  # fp32/bf16: the scaler is off, loss as is
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    return loss_sum


def forward_backward(strategy, x: torch.Tensor, y: torch.Tensor, precision: Precision | None = None,
                     phase: Phase = no_phase) -> torch.Tensor:
    """The first half of the step: forward, backward and the gradient communication."""
    precision = precision or Precision()
    with phase("forward_backward", None):
        loss = strategy.forward_backward(x, y, precision, phase)
    with phase("finish_grads", None):
        strategy.finish_grads()  # wait for (or do) the all-reduce: communication, not compute
    return loss


def optimizer_step(strategy, grad_clip: float = 0.0, precision: Precision | None = None,
                   phase: Phase = no_phase) -> torch.Tensor | None:
    """The second half: clip, step (fp16: or skip), zero_grad; returns the global norm (None
    when neither clipping nor fp16 needed it)."""
    precision = precision or Precision()
    scaler, grad_norm = precision.scaler, None
    with phase("update", None):
        if scaler.is_enabled():
            scaler.unscale_(strategy.optimizer)
        if grad_clip > 0 or scaler.is_enabled():  # the norm over all ranks' gradients
            with phase("clip_grad_norm", None):
                grad_norm = strategy.clip_grad_norm_(grad_clip if grad_clip > 0 else math.inf)
        with phase("optimizer_step", None):
            if scaler.is_enabled():
                scale = scaler.get_scale()
                precision.good_steps = _fp16_step(strategy, scaler, grad_norm, precision.good_steps)
                precision.skipped += scaler.get_scale() < scale  # backed off: the step was skipped
            else:
                strategy.step()
        with phase("zero_grad", None):
            strategy.zero_grad()
    return grad_norm


def train_step(strategy, x: torch.Tensor, y: torch.Tensor, grad_clip: float = 0.0,
               precision: Precision | None = None, phase: Phase = no_phase) -> StepResult:
    """One optimizer step on one global batch; x, y (accum, B, T) are this rank's micro-batches."""
    precision = precision or Precision()
    loss = forward_backward(strategy, x, y, precision, phase)
    return StepResult(loss, optimizer_step(strategy, grad_clip, precision, phase))


def _fp16_step(strategy, scaler, grad_norm: torch.Tensor, good_steps: int) -> int:
    """fp16 + loss scaling: skip the step on inf/NaN gradients and halve the scale; double it
    after ``growth_interval`` good steps (GradScaler's rule). The decision uses the *global* norm
    so every rank agrees, also when gradients are sharded."""
    finite = bool(torch.isfinite(grad_norm))  # a host sync per step, as GradScaler.step makes too
    scale = scaler.get_scale()
    if finite:
        strategy.step()
        good_steps += 1
        if good_steps == scaler.get_growth_interval():
            scale, good_steps = scale * scaler.get_growth_factor(), 0
    else:
        scale, good_steps = scale * scaler.get_backoff_factor(), 0
    scaler.update(scale)  # also clears the per-step "already unscaled" record
    return good_steps
