"""What Fabric's strategies do inside, read from the framework's own objects (notebook 11).

    from course_lib.experiments.frameworks_inside import ddp_inside, fsdp2_inside
    ddp = run_ranks(ddp_inside, 2, 0.05)[0]             # DDP's hooks and buckets
    fsdp = run_ranks(fsdp2_inside, 2)[0]                 # what FSDP2 shards, and when it gathers

DDP (Li et al. 2020, "PyTorch Distributed", Sec. 3.2): ``DistributedDataParallel`` builds a C++
``Reducer`` that puts one autograd hook on each parameter's gradient accumulator and packs the
gradients into buckets of ``bucket_cap_mb`` in backward order; a bucket's all-reduce starts as
soon as its last gradient is ready. Read here: the bucket sizes DDP logs
(``_get_ddp_logging_data``), the buckets as they are all-reduced (a communication hook receives
each ``GradBucket``: its index, its parameters, the time since backward began), the reducer's
hook entry points; beside them the course's rule (:func:`course_lib.parallel.data.buckets.bucket_indices`)
on the same tensors, which ``course_lib.parallel.data.ddp.DataParallelBucket`` applies from
``register_post_accumulate_grad_hook``.

FSDP2 (``torch.distributed.fsdp.fully_shard``, PyTorch docs): every parameter becomes a ``DTensor``
sharded on dim 0 over the data-parallel mesh; before a unit's forward (and again before its
backward) its parameters are all-gathered, after it they are freed again, and after its backward
its gradients are reduce-scattered. Read here: each parameter's full and local shape and
placement, and the sequence of unit forwards/backwards and collectives of one step, beside the
course's ZeRO-3 (``course_lib.parallel.zero.zero3.FullyShardedDataParallel._pre_forward`` / ``_pre_backward``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from course_lib.experiments.frameworks_fabric import (
    CollectiveCounter,
    fabric_setup,
    fabric_step,
    make_fabric,
    wrapped,
)
from course_lib.experiments.frameworks_gpt import SMALL, adamw_with_lr
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.hardware import MiB
from course_lib.parallel.data.buckets import bucket_indices
from course_lib.parallel.zero.units import default_units


def _batch(cfg: GPTConfig, rank: int, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed + rank)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def ddp_inside(rank: int, world: int, bucket_cap_mb: float = 0.05, gpt: dict | None = None,
               steps: int = 2) -> dict:
    """Fabric's DDP with small buckets, taken apart: per step, the buckets in the order DDP
    all-reduced them ({index, params, bytes, ms after backward began}); DDP's logged bucket
    sizes before the first step (one bucket: without ``find_unused_parameters`` DDP does not
    bucket before it has seen the gradients' order) and after (it rebuilds them in that order);
    the course's buckets for the same tensors in backward order; the reducer's hook methods."""
    cfg = GPTConfig(**{**SMALL, **(gpt or {})})
    torch.manual_seed(0)
    fabric = make_fabric("ddp", bucket_cap_mb=bucket_cap_mb)
    model, opt = fabric_setup(fabric, GPT(cfg), adamw_with_lr(1e-3))
    ddp = wrapped(model)
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    clock = {"t0": 0.0}
    seen: list[dict] = []

    def recording_hook(state, bucket):
        buf = bucket.buffer()
        seen.append({"index": bucket.index(), "params": [names[id(p)] for p in bucket.parameters()],
                     "bytes": buf.numel() * buf.element_size(),
                     "ms_after_backward_began": 1e3 * (time.perf_counter() - clock["t0"])})
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, recording_hook)
    logged = {"before first step": ddp._get_ddp_logging_data()["bucket_sizes"]}
    per_step = []
    x, y = _batch(cfg, rank)
    for _ in range(steps):
        seen.clear()
        clock["t0"] = time.perf_counter()  # the forward is short; the buckets fire in backward
        fabric_step(fabric, model, opt, x, y)
        per_step.append(list(seen))
        logged[f"after step {len(per_step)}"] = ddp._get_ddp_logging_data()["bucket_sizes"]
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    backward_order = params[::-1]  # the reverse of definition order (parallel/data/buckets.py)
    sizes = [p.numel() * p.element_size() for p in backward_order]
    # the first bucket's cap in DDP's rebuild: newer torch keeps it in _bucket_config (1 MiB only
    # with the default bucket_cap_mb, else the cap itself); older torch always gave its Reducer 1 MiB
    first_cap = getattr(getattr(ddp, "_bucket_config", None), "first_bucket_bytes_cap",
                        getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None))
    course = bucket_indices(sizes, bucket_cap_mb * MiB, first_cap)
    return {"bucket_cap_bytes": ddp.bucket_bytes_cap, "first_bucket_cap_bytes": first_cap,
            "logged_bucket_sizes": logged, "buckets_by_step": per_step,
            "course_buckets": [{"params": [names[id(backward_order[i])] for i in b],
                                "bytes": sum(sizes[i] for i in b)} for b in course],
            "reducer_hook_methods": sorted(m for m in dir(ddp.reducer) if "hook" in m),
            "num_params": len(params)}


def fsdp2_inside(rank: int, world: int, gpt: dict | None = None) -> dict:
    """Fabric's ModelParallelStrategy with FSDP2, taken apart: each parameter's full shape, local
    shape and placement on this rank; the FSDP units; one step as a sequence of events
    (a unit's forward or backward beginning, each all-gather and reduce-scatter with its bytes)."""
    cfg = GPTConfig(**{**SMALL, **(gpt or {})})
    torch.manual_seed(0)
    fabric = make_fabric("fsdp2")
    model, opt = fabric_setup(fabric, GPT(cfg), adamw_with_lr(1e-3))
    root = wrapped(model)
    shards = []
    for name, p in root.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        shards.append({"param": name, "full shape": tuple(p.shape), "local shape": tuple(local.shape),
                       "placement": str(getattr(p, "placements", "replicated"))})
    counter = CollectiveCounter()
    units = {"root": root, **{f"transformer.h.{i}": u for i, u in enumerate(default_units(root))}}
    handles = []
    for label, unit in units.items():
        handles.append(unit.register_forward_pre_hook(lambda m, a, label=label: counter.note("forward", label)))
        if label != "root":  # the root's input (token ids) needs no gradient: no backward hook there
            handles.append(unit.register_full_backward_pre_hook(
                lambda m, g, label=label: counter.note("backward", label)))
    x, y = _batch(cfg, rank)
    with counter:
        fabric_step(fabric, model, opt, x, y)
    for h in handles:
        h.remove()
    fsdp_units = [n or "root" for n, m in root.named_modules() if type(m).__name__.startswith("FSDP")]
    return {"shards": shards, "fsdp_units": fsdp_units, "events": counter.events,
            "volume": dict(counter.volume), "calls": dict(counter.calls)}
