"""The peak memory of one real training step, measured, against :func:`course_lib.analysis.memory.step_peak`.

    from course_lib.experiments.step_memory import measure_step_peak
    r = measure_step_peak(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=128, vocab_size=4096),
                          batch_size=8, dtype="bfloat16")
    r["measured_bytes"], r["model_bytes"], r["peak_op"]

On a CPU there is no allocator to ask, so :class:`LiveTensorBytes` counts the storage of every
tensor alive: it sees each op's outputs (a ``TorchDispatchMode``, which backward's ops go through
too) and drops a storage's bytes when Python frees it; the highest count, and the op that reached
it, is the peak. On a GPU the same step is read from ``torch.cuda.max_memory_allocated``.
The CPU count holds tensors only, what the model predicts (no allocator rounding, no workspaces);
the GPU's counts what the caching allocator handed out, its rounding to 512-byte blocks, cuBLAS's
workspaces and whatever was already on the device included (``course check-gpu``'s memory step
subtracts the device's own baseline first).
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from course_lib.analysis.memory import step_peak
from course_lib.gpt.model import GPT, GPTConfig, make_adamw
from course_lib.parallel.parallelize import parallelize
from course_lib.parallel.step import Precision, train_step
from course_lib.parallel.strategy import build_strategy


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes() as m:`` ... then ``m.peak`` bytes (and ``m.peak_op``) of tensor
    storage alive at once; :meth:`track` adds tensors made before (weights, optimizer state)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.peak_op = ""
        self._bytes: dict[int, int] = {}

    def track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._bytes or storage.nbytes() == 0:
            return  # a view of a storage already counted, or an empty one
        self._bytes[key] = storage.nbytes()
        self.live += storage.nbytes()
        weakref.finalize(storage, self._free, key)  # runs when Python frees the storage

    def _free(self, key: int) -> None:
        self.live -= self._bytes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.track(t)
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, func.__name__  # e.g. "_log_softmax_backward_data.default"
        return out


def _live_step_peak(strategy, x: torch.Tensor, y: torch.Tensor, precision: Precision) -> tuple[int, int, str]:
    """One step of ``strategy`` under :class:`LiveTensorBytes`, its weights and optimizer state counted
    from the start: (bytes of those states, the peak beyond the inputs x and y, the op of the peak)."""
    meter = LiveTensorBytes()
    for t in [*strategy.module.parameters(), *(v for s in strategy.optimizer.state.values() for v in s.values())]:
        meter.track(t)
    states = meter.live
    for t in (x, y):
        meter.track(t)
    with meter:
        train_step(strategy, x, y, precision=precision)
    return states, meter.peak - x.nbytes - y.nbytes, meter.peak_op


def measure_step_peak(cfg: GPTConfig, batch_size: int, dtype: str = "float32", device: str = "cpu",
                      seed: int = 0, loss_chunks: int = 0) -> dict:
    """Train two steps of ``GPT(cfg)`` with the trainer's fused AdamW and step on ``device`` and
    measure the second one's peak (the first creates Adam's moments); returns it with the model,
    which prices the plain head and loss (``loss_chunks`` > 0: :meth:`GPT.set_loss_chunks`)."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(device).set_loss_chunks(loss_chunks)
    single = build_strategy("single", model, lambda m: make_adamw(m, lr=1e-4, weight_decay=0.1))  # the trainer's
    autocast = (nullcontext() if dtype == "float32"
                else torch.autocast(device.split(":")[0], dtype=getattr(torch, dtype)))
    precision = Precision(autocast)
    x = torch.randint(cfg.vocab_size, (1, batch_size, cfg.block_size), device=device)  # (micro, B, T)
    y = torch.roll(x, -1, dims=2)
    train_step(single, x, y, precision=precision)
    inputs = x.nbytes + y.nbytes
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        train_step(single, x, y, precision=precision)
        torch.cuda.synchronize(device)
        states = before - inputs
        measured, op = torch.cuda.max_memory_allocated(device) - inputs, "(max_memory_allocated)"
    else:
        states, measured, op = _live_step_peak(single, x, y, precision)
    n = sum(p.numel() for p in model.parameters())
    peak = step_peak(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size, batch_size, dtype,
                     num_params=n, device_type=device.split(":")[0], dropout=cfg.dropout, bias=cfg.bias)
    return {"measured_bytes": measured, "model_bytes": peak.total, "ratio": measured / peak.total,
            "peak_op": op, "states_bytes": states, "model_states_bytes": peak.weights + peak.optimizer,
            "parts": peak.parts(), "num_params": n, "dtype": dtype, "batch_size": batch_size}


def tp_step_peak_worker(rank: int, world_size: int, model_args: dict, batch_size: int, dtype: str = "float32",
                        sequence_parallel: bool = False) -> dict:
    """One rank of a tensor-parallel group of ``world_size`` (gloo, CPU): two steps of the trainer's
    step on this rank's shards (:func:`course_lib.parallel.parallelize.parallelize`), the second one
    measured as :func:`measure_step_peak` does. Returns this rank's measured peak beyond its
    inputs, the states it began with and the op of the peak (run it with
    :func:`course_lib.launch.spawn.run_ranks`)."""
    torch.manual_seed(0)  # the same full model on every rank; parallelize keeps this rank's shards
    model = GPT(GPTConfig(**model_args))
    strategy = parallelize(model, lambda m: make_adamw(m, lr=1e-4, weight_decay=0.1), "single", tp=world_size,
                           sequence_parallel=sequence_parallel)
    autocast = nullcontext() if dtype == "float32" else torch.autocast("cpu", dtype=getattr(torch, dtype))
    precision = Precision(autocast)
    x = torch.randint(model_args["vocab_size"], (1, batch_size, model_args["block_size"]))  # (micro, B, T)
    y = torch.roll(x, -1, dims=2)
    train_step(strategy, x, y, precision=precision)  # makes Adam's moments
    states, measured, op = _live_step_peak(strategy, x, y, precision)
    return {"measured_bytes": measured, "states_bytes": states, "peak_op": op}
