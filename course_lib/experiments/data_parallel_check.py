"""Data parallelism checked against one process, and its communication counted (notebook 3).

    from course_lib.launch import notebook_launcher
    from course_lib.experiments.data_parallel_check import VARIANTS, compare_with_single_process
    results = notebook_launcher(compare_with_single_process, (VARIANTS,), nproc=2)

:func:`compare_with_single_process` runs on every rank of an initialised process group. For each
variant (a strategy of :mod:`course_lib.parallel.strategy` and its options) it

1. builds the GPT from a *different* seed on every rank, on purpose, and records a checksum of the
   parameters on each rank before and after wrapping the model: the strategy's broadcast from
   rank 0 must make them equal;
2. trains a few steps, each rank on its own slice of every global batch, with gradient
   accumulation (``no_sync`` on all micro-batches but the last);
3. compares the parameters with a single-process reference that started from rank 0's weights
   and took the same steps on the whole global batch: data parallelism is the same algorithm;
4. counts the gradient all-reduces of the last step (calls and bytes) and times the step.

Our strategies count their collectives themselves (:class:`course_lib.parallel.comms.Comms`);
PyTorch's DDP reduces its buckets in C++, so for ``torch_ddp`` a DDP communication hook counts
each bucket before handing it to the default all-reduce hook.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from course_lib.analysis.comm_cost import collective_time
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.parallel.data.buckets import bucket_indices
from course_lib.parallel.step import train_step
from course_lib.parallel.strategy import build_strategy

# label -> (strategy name, keyword arguments)
VARIANTS: dict[str, tuple[str, dict]] = {
    "ddp_naive": ("ddp_naive", {}),
    "ddp, one big bucket": ("ddp", {"bucket_cap_mb": 25.0, "first_bucket_cap_mb": None}),
    "ddp, small buckets": ("ddp", {"bucket_cap_mb": 0.05}),
    "torch_ddp": ("torch_ddp", {}),
}
SMALL_GPT = {"block_size": 32, "vocab_size": 65, "n_layer": 2, "n_head": 2, "n_embd": 32, "bias": False, "dropout": 0.0}


def param_checksum(model: torch.nn.Module) -> float:
    """Sum of all parameters in float64: equal on two ranks iff (almost surely) the weights are."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _ddp_bucket_counter(ddp_model) -> dict:
    """Count DDP's bucket all-reduces: a comm hook that records each bucket, then all-reduces it
    with PyTorch's default hook (average over ranks), so training is unchanged."""
    counter = {"calls": 0, "bytes": 0}

    def hook(state, bucket):
        buf = bucket.buffer()
        state["calls"] += 1
        state["bytes"] += buf.numel() * buf.element_size()
        return allreduce_hook(None, bucket)

    ddp_model.register_comm_hook(counter, hook)
    return counter


def _adamw(lr: float):
    return lambda m: torch.optim.AdamW(m.parameters(), lr=lr, foreach=True)


def global_batches(cfg, steps: int, global_batch: int, seed: int):
    """``steps`` batches of random tokens: x, y of shape (global_batch, block_size) each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, cfg.vocab_size, (global_batch, cfg.block_size + 1), generator=g)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out


def reference_run(cfg, batches, lr: float, seed: int):
    """One process, the whole global batch per step, from the seed rank 0 uses: (model, losses)."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    single = build_strategy("single", model, _adamw(lr))
    # one micro-batch: the mean over every token of the global batch
    losses = [train_step(single, x[None], y[None]).loss.item() for x, y in batches]
    return model, losses


def compare_with_single_process(variants: dict[str, tuple[str, dict]] = VARIANTS, gpt_kwargs: dict | None = None,
                                micro_batch: int = 4, grad_accum: int = 2, steps: int = 3,
                                lr: float = 1e-3, seed: int = 0) -> dict[str, dict]:
    """Train each variant on this rank's slices and compare with one process (module docstring).

    Per variant: ``checksums_before`` / ``checksums_after`` (one per rank), ``losses`` (global
    mean per step), ``ref_losses``, ``max_param_diff`` (largest |parameter - reference|),
    ``allreduce_calls`` and ``allreduce_MB`` of the last step, ``buckets`` (ours), ``step_ms``
    (mean over the steps after the first) and ``comm_ms`` (exposed wait in collectives per step,
    ours only: DDP's happens inside backward).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**(gpt_kwargs or SMALL_GPT))
    per_rank = micro_batch * grad_accum
    batches = global_batches(cfg, steps, per_rank * world, seed + 1)
    reference, ref_losses = reference_run(cfg, batches, lr, seed)
    results = {}
    for label, (name, kwargs) in variants.items():
        torch.manual_seed(seed + rank)  # a different initialisation on every rank, on purpose
        model = GPT(cfg)
        before = [None] * world
        dist.all_gather_object(before, param_checksum(model))
        strategy = build_strategy(name, model, _adamw(lr), **kwargs)  # broadcasts rank 0's state
        after = [None] * world
        dist.all_gather_object(after, param_checksum(model))
        ddp_counter = _ddp_bucket_counter(strategy.model) if name == "torch_ddp" else None
        comms = getattr(strategy, "comms", None)
        losses, step_s, comm_s = [], [], []
        for step, (x, y) in enumerate(batches):
            mine = slice(rank * per_rank, (rank + 1) * per_rank)  # this rank's rows of the global batch
            xr, yr = x[mine], y[mine]
            last_step = step == steps - 1
            if last_step:  # count the last step only (the first ones include one-off set-up)
                if comms is not None:
                    comms.reset()
                if ddp_counter is not None:
                    ddp_counter.update(calls=0, bytes=0)
            comm_start = strategy.comm_s
            t0 = time.perf_counter()
            # (grad_accum, micro_batch, T): micro-batch i is rows i * micro_batch ... of this rank's
            local = train_step(strategy, xr.view(grad_accum, micro_batch, -1),
                               yr.view(grad_accum, micro_batch, -1)).loss
            step_s.append(time.perf_counter() - t0)
            comm_s.append(strategy.comm_s - comm_start)
            dist.all_reduce(local)  # the loss of the global batch, for the table only
            losses.append(local.item() / world)
        ref_params = dict(reference.named_parameters())
        diff = max((p.detach() - ref_params[n].detach()).abs().max().item()
                   for n, p in strategy.module.named_parameters())
        if comms is not None:
            calls, nbytes = comms.calls.get("all_reduce", 0), comms.volume.get("all_reduce", 0) / 2
        else:
            calls, nbytes = ddp_counter["calls"], ddp_counter["bytes"]
        timed = step_s[1:] or step_s
        results[label] = {
            "strategy": name, "checksums_before": before, "checksums_after": after, "losses": losses,
            "ref_losses": ref_losses, "max_param_diff": diff, "allreduce_calls": calls,
            "allreduce_MB": nbytes / 1e6, "buckets": len(getattr(strategy.model, "buckets", [])) or None,
            "step_ms": 1e3 * sum(timed) / len(timed),
            "comm_ms": 1e3 * sum(comm_s[1:] or comm_s) / len(timed) if comms is not None else None,
        }
    return results


def bucket_sizes(tensor_bytes, cap_bytes: float, first_cap_bytes: float | None = None) -> list[int]:
    """Pack tensors (given in backward order) into buckets the way DataParallelBucket does
    (:func:`course_lib.parallel.data.buckets.bucket_indices`): bytes per bucket."""
    sizes = list(tensor_bytes)
    return [sum(sizes[i] for i in group) for group in bucket_indices(sizes, cap_bytes, first_cap_bytes)]


def allreduce_seconds(tensor_bytes, p: int, *, bandwidth: float, alpha: float,
                      cap_bytes: float | None = None) -> tuple[int, float]:
    """(messages, seconds) to all-reduce gradients of these sizes with the ring algorithm of
    :mod:`course_lib.analysis.comm_cost`: one message per tensor (``cap_bytes=None``) or per bucket.

    Communication only, none of it hidden behind backward: what overlap can save, not what it does.
    """
    messages = list(tensor_bytes) if cap_bytes is None else bucket_sizes(tensor_bytes, cap_bytes)
    return len(messages), sum(collective_time("all_reduce", n, p, bandwidth=bandwidth, alpha=alpha)
                              for n in messages)


def summary_rows(results: dict[str, dict]) -> list[dict]:
    """One table row per variant from :func:`compare_with_single_process`'s result on one rank."""
    rows = []
    for label, r in results.items():
        rows.append({"variant": label, "ranks agree before wrap": len(set(r["checksums_before"])) == 1,
                     "ranks agree after wrap": len(set(r["checksums_after"])) == 1,
                     "max |param - one process|": r["max_param_diff"],
                     "final loss": r["losses"][-1], "one-process loss": r["ref_losses"][-1],
                     "all-reduces / step": r["allreduce_calls"], "MB all-reduced / step": r["allreduce_MB"],
                     "step ms": r["step_ms"], "exposed comm ms": r["comm_ms"]})
    return rows
