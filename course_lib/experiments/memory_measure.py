"""Measure where training memory and communication go on real processes, to check the formulas.

    from course_lib.experiments.memory_measure import saved_activation_bytes, full_recomputation
    from course_lib.experiments.memory_measure import measure_strategies  # notebook_launcher(measure_strategies, ...)

:mod:`course_lib.analysis.memory` predicts bytes per device from the ZeRO paper (Rajbhandari et al. 2020)
and Korthikanti et al. 2022; this module counts what the tensors really hold:

* model states: :func:`course_lib.parallel.footprint.measure_model_states` (each storage once;
  a freed ZeRO-3 parameter costs nothing; DTensors count their local shard), sampled during
  forward and backward by :class:`PeakTracker`, because a gradient is largest during backward,
  not after it (ZeRO-2/3 free each bucket once it is reduce-scattered);
* activations: what autograd saves for backward (``saved_tensors_hooks``), parameters excluded;
* communication: the bytes each rank hands to collectives, counted under a dispatch mode that
  sees every ``c10d`` operation (:class:`CommCounter`, so PyTorch's FSDP2 is counted the same way
  as our ZeRO). Volumes use the paper's accounting (Sec. 7): all-reduce 2S, reduce-scatter S
  (its whole input), all-gather S (its whole output).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from course_lib.analysis.comm_cost import zero_comm_volume
from course_lib.analysis.memory import model_state_bytes
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.parallel.comms import VOLUME_FACTOR
from course_lib.parallel.footprint import measure_model_states
from course_lib.parallel.step import train_step
from course_lib.parallel.strategy import build_strategy
from course_lib.trainer.metrics import SavedTensorMeter

# ------------------------------------------------------------------ counting bytes of tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor holds only its shard


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries are skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = _local(t).untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def comm_buffer_bytes(strategy) -> int:
    """Bytes our ZeRO strategies keep alive for collectives still in flight (``pending``)."""
    return storage_bytes(t for item in getattr(strategy, "pending", ())
                         for t in item if torch.is_tensor(t))


class PeakTracker:
    """Largest parameter and gradient bytes seen during forward and backward.

    Samples when a module starts its forward (after ZeRO-3 gathered its parameters: our hooks are
    registered after the strategy's, so they run after them) and when autograd finished
    accumulating a parameter's gradient (after ZeRO-2/3 reduce-scattered a finished bucket).
    """

    def __init__(self, model: nn.Module, strategy):
        self.model, self.strategy = model, strategy
        self.peak = {"params": 0, "grads": 0, "comm_buffers": 0}
        self.handles = [m.register_forward_pre_hook(lambda m, a: self.sample())
                        for m in model.modules()]
        self.handles += [p.register_post_accumulate_grad_hook(lambda p: self.sample())
                         for p in strategy.compute_parameters() if p.requires_grad and not hasattr(p, "to_local")]

    def sample(self) -> None:
        states = measure_model_states(self.strategy)
        now = {"params": states.params, "grads": states.grads,
               "comm_buffers": comm_buffer_bytes(self.strategy)}
        for k, v in now.items():
            self.peak[k] = max(self.peak[k], v)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ------------------------------------------------------------------ activations


def saved_activation_bytes(model: nn.Module, *inputs) -> tuple[int, torch.Tensor]:
    """(bytes autograd keeps for backward, loss) for one forward of ``model(*inputs)``.

    Every tensor saved for backward is counted by its storage, once; the parameters are not
    activations and are left out (:class:`course_lib.trainer.metrics.SavedTensorMeter`).
    Compare with :func:`course_lib.analysis.activations.activation_bytes`.
    """
    with SavedTensorMeter(model) as meter:
        out = model(*inputs)
    loss = out[1] if isinstance(out, tuple) else out
    return meter.bytes, loss


@contextlib.contextmanager
def full_recomputation(model: nn.Module):
    """Inside the ``with``, every transformer block (each entry of an ``nn.ModuleList``) runs under
    ``torch.utils.checkpoint``: backward recomputes the block, so only its input is kept
    (Korthikanti et al. 2022's "full recomputation", 2sbh bytes per layer in 16-bit)."""
    blocks = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    for block in blocks:
        plain = type(block).forward.__get__(block)  # the class's forward, bound to this block
        block.forward = functools.partial(checkpoint, plain, use_reentrant=False)
    try:
        yield model
    finally:
        for block in blocks:
            del block.forward  # back to the class's forward


# ------------------------------------------------------------------ communication

_C10D_OPS = {"allreduce_": "all_reduce", "_reduce_scatter_base_": "reduce_scatter",
             "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
             "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
             "allgather_": "all_gather", "broadcast_": "broadcast"}


class CommCounter(TorchDispatchMode):
    """Count the collectives run inside ``with CommCounter() as c:`` and their volume per rank.

    ``volume[op]``: bytes in the ZeRO paper's accounting (all-reduce 2S; reduce-scatter the whole
    input S; all-gather the whole output S). Works for any code that calls torch.distributed
    collectives from Python (our strategies, FSDP2); DDP's C++ reducer bypasses it.
    """

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.volume: dict[str, int] = defaultdict(int)

    def count(self, op: str, nbytes: int) -> None:
        """One collective of ``nbytes`` (its full-size side): a call, and its volume."""
        self.calls[op] += 1
        self.volume[op] += VOLUME_FACTOR[op] * nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("c10d::"):
            op = _C10D_OPS.get(name.removeprefix("c10d::"))
            if op is not None:
                # the full-size side: the output of an all-gather, the input otherwise
                side = args[0] if op == "all_gather" else args[1] if op == "reduce_scatter" else args[0]
                tensors = side if isinstance(side, (list, tuple)) else [side]
                flat = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]
                self.count(op, sum(t.numel() * t.element_size() for t in flat if torch.is_tensor(t)))
        return func(*args, **kwargs)

    @property
    def volume_bytes(self) -> int:
        return sum(self.volume.values())


# ------------------------------------------------------------------ one run per strategy


def _watcher(strategy, seen: dict):
    """A phase hook for :func:`~course_lib.parallel.step.train_step` that writes into ``seen`` the
    gradient bytes after the communication (and samples ``seen["tracker"]``) and the model
    states after the optimizer step."""
    def phase(name: str, micro: int | None):
        if name == "update":  # the gradients after the last reduce-scatter landed
            if seen["tracker"]:
                seen["tracker"].sample()
            seen["grads"] = measure_model_states(strategy).grads
        elif name == "zero_grad":  # after the step: what a rank keeps, gradients aside
            seen["states"] = measure_model_states(strategy)
        return contextlib.nullcontext()
    return phase


def measure_strategies(names: list[str], gpt_kwargs: dict, batch_size: int, steps: int = 2,
                       bucket_cap_mb: float = 25.0, lr: float = 1e-3, seed: int = 0) -> dict[str, dict]:
    """Train the same GPT for ``steps`` with each strategy in ``names``; measure the last step.

    Call it on every rank of an initialised process group, e.g.
    ``notebook_launcher(measure_strategies, (names, gpt_kwargs, 4), nproc=2)``. Each strategy
    starts from the same weights (seed) and sees the same data (rank r takes its own slice of
    every global batch), with AdamW in fp32, so all of them must report the same losses. Per
    strategy: ``num_params``, ``losses``, ``kept`` (bytes held after the last step: params, grads
    before zero_grad, optimizer), ``peak`` (largest params/grads/comm buffers during the last
    forward and backward), ``volume`` and ``calls`` (collectives of the last step), ``step_s``.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**gpt_kwargs)
    results = {}
    for name in names:
        torch.manual_seed(seed)
        model = GPT(cfg)
        num_params = model.num_params()  # before wrapping: a ZeRO-3 module shows this rank's shards
        extra = {"bucket_cap_mb": bucket_cap_mb} if name in ("ddp", "zero1", "zero2") else {}
        strategy = build_strategy(
            name, model, lambda m: torch.optim.AdamW(m.parameters(), lr=lr, foreach=True), **extra)
        gen = torch.Generator().manual_seed(seed + 1)
        losses, seen = [], {}
        phase = _watcher(strategy, seen)
        for step in range(steps):
            last = step == steps - 1
            idx = torch.randint(0, cfg.vocab_size, (batch_size * world_size, cfg.block_size + 1),
                                generator=gen)
            x, y = idx[rank::world_size, :-1].contiguous(), idx[rank::world_size, 1:].contiguous()
            tracker = seen["tracker"] = PeakTracker(model, strategy) if last else None
            counter = CommCounter()
            t0 = time.perf_counter()
            with counter if last else contextlib.nullcontext():
                loss = train_step(strategy, x[None], y[None], phase=phase).loss  # one micro-batch
            step_s = time.perf_counter() - t0
            mean_loss = loss.clone()
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / world_size)
            if last:
                tracker.remove()
                states = seen["states"]
                kept = {"params": states.params, "grads": seen["grads"], "optimizer": states.optimizer}
                results[name] = {"num_params": num_params, "losses": losses, "kept": kept,
                                 "peak": dict(tracker.peak), "volume": dict(counter.volume),
                                 "calls": dict(counter.calls), "step_s": step_s}
    return results


# ------------------------------------------------------------------ measured against the formulas

STAGE_OF = {"ddp": 0, "ddp_naive": 0, "torch_ddp": 0, "zero1": 1, "torch_zero1": 1, "zero2": 2,
            "fsdp_grad_op": 2, "zero3": 3, "fsdp_full": 3}


def compare_with_formulas(results: dict[str, dict], world_size: int) -> list[dict]:
    """One row per strategy: measured bytes per rank next to the ZeRO paper's formulas.

    Memory: params (kept between steps), grads (peak during backward, or after it), optimizer
    (kept), against :func:`course_lib.analysis.memory.model_state_bytes` in fp32 (4 + 4 + 8 bytes per
    parameter). Communication: the step's collective volume against
    :func:`course_lib.analysis.comm_cost.zero_comm_volume` (paper accounting, 4-byte elements).
    """
    rows = []
    for name, r in results.items():
        stage = STAGE_OF[name]
        psi = r["num_params"]
        formula = model_state_bytes(psi, world_size, stage, dtype="fp32")
        grads = max(r["peak"]["grads"], r["kept"]["grads"])
        measured = r["kept"]["params"] + grads + r["kept"]["optimizer"]
        comm_formula = sum(zero_comm_volume(psi, stage, world_size, bytes_per_elem=4, exact=False).values())
        rows.append({
            "strategy": name, "stage": stage,
            "params MB": r["kept"]["params"] / 1e6, "grads MB": grads / 1e6,
            "optimizer MB": r["kept"]["optimizer"] / 1e6, "total MB": measured / 1e6,
            "formula MB": formula.total / 1e6, "measured/formula": measured / formula.total,
            "comm MB": sum(r["volume"].values()) / 1e6, "comm formula MB": comm_formula / 1e6,
            "comm measured/formula": sum(r["volume"].values()) / comm_formula,
            "peak params MB": r["peak"]["params"] / 1e6,
            "comm buffers MB": r["peak"]["comm_buffers"] / 1e6,
            "final loss": r["losses"][-1],
        })
    return rows
