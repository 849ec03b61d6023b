"""Where one training step's time goes on each rank: computation, communication, both, neither.

    from course_lib.experiments.profiling import profile_training_step, step_time_table
    from course_lib.notebook.plots import plot_step_timeline
    ranks = profile_training_step("ddp", world_size=2, trace_dir="runs/trace")  # 2 gloo processes
    step_time_table(ranks)           # per rank: step, compute, comm, overlap, exposed comm, other (ms)
    plot_step_timeline(ranks)   # the step drawn as a timeline, one pair of lanes per rank

Each rank builds the same GPT, wraps it in a trainer Strategy (course_lib.parallel.strategy),
runs a few warm-up steps, then records one step (the trainer's: micro-batches with no_sync,
finish_grads, global-norm clipping, optimizer step, zero_grad) with ``torch.profiler``.
:func:`course_lib.experiments.step_intervals.classify_events` sorts the recorded events into compute
and communication time; ``overlap`` is communication hidden behind computation, ``exposed``
the communication the step waits for, ``other`` what is neither.

``trace_dir`` keeps each rank's Chrome trace (``rank{r}.json``) and one merged file
(``trace.json``, rank r as process r) to open in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from course_lib.experiments.step_intervals import STEP, classify_events
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.launch.placement import plan_ranks
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.step import train_step
from course_lib.parallel.strategy import build_strategy
from course_lib.registry import STRATEGIES

# ------------------------------------------------------------------ the profiled step (one rank)

def _events(prof) -> list[dict]:
    return [{"name": e.name, "thread": e.thread, "start": e.time_range.start, "end": e.time_range.end,
             "device": "cuda" if e.device_type == DeviceType.CUDA else "cpu"} for e in prof.events()]


# the step's phases (course_lib.parallel.step) recorded, under the names classify_events reads
LABELS = {name: name for name in ("forward", "backward", "finish_grads", "clip_grad_norm", "optimizer_step",
                                  "zero_grad")}


def labelled(label, names: dict[str, str] = LABELS):
    """A phase hook for :func:`~course_lib.parallel.step.train_step`: the phases in ``names``
    under ``label(names[phase])`` (a record_function), the others unlabelled."""
    return lambda name, micro: label(names[name]) if name in names else nullcontext()


def profile_worker(rank: int, world_size: int, spec: dict) -> dict:
    """One rank of :func:`profile_training_step` (a module-level function, so "spawn" can start it)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # else the profiler's library logs every start and stop
    device = spec["devices"][rank]  # the plan's: ranks beyond the GPUs share them
    if device != "cpu":
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same weights on every rank (the strategies broadcast them anyway)
    model = GPT(GPTConfig(**spec["gpt"])).to(device)
    strategy = build_strategy(spec["strategy"], model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
                              **spec["strategy_kwargs"])
    accum, shape = spec["grad_accum"], (spec["batch_size"], spec["gpt"]["block_size"])
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own batch, as in data parallelism
    # random tokens: a step costs the same whatever the text, and no data folder is needed
    x = torch.randint(spec["gpt"]["vocab_size"], (accum, *shape), generator=gen).to(device)
    y = torch.randint(spec["gpt"]["vocab_size"], (accum, *shape), generator=gen).to(device)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def step(label=nullcontext):
        train_step(strategy, x, y, grad_clip=1.0, phase=labelled(label))  # the trainer's step
        sync()

    for _ in range(spec["warmup"]):  # first steps allocate Adam's states, warm up caches
        step(lambda name: nullcontext())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    torch.distributed.barrier()  # start together, so the step is not mostly waiting for the other rank
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        with record_function(STEP):
            step(record_function)
        wall_ms = 1e3 * (time.perf_counter() - t)
    result = classify_events(_events(prof))
    result.update(rank=rank, world_size=world_size, strategy=spec["strategy"], wall_ms=wall_ms)
    if spec["trace_dir"]:
        path = Path(spec["trace_dir"]) / f"rank{rank}.json"
        prof.export_chrome_trace(str(path))
        result["trace"] = str(path)
    return result


def profile_training_step(strategy: str = "ddp", world_size: int = 2, gpt: dict | None = None, batch_size: int = 8,
                 grad_accum: int = 1, warmup: int = 2, trace_dir: str | os.PathLike | None = None,
                 device: str = "cpu", threads: int = 1, **strategy_kwargs) -> list[dict]:
    """Profile one training step of ``strategy`` on ``world_size`` local ranks; one dict per rank.

    gpt: GPTConfig fields (default: a 2-layer, 128-wide character model, block 64).
    device "cpu" uses gloo; "cuda" NCCL with one GPU per rank, or gloo where ranks share a GPU
    (:func:`course_lib.launch.placement.plan_ranks`: 2 ranks on Colab's one T4). ``strategy_kwargs`` go to the
    strategy (e.g. ``bucket_cap_mb=0.1`` for ddp: several buckets, so communication overlaps
    backward). The results say what :func:`classify_events` says, plus wall_ms (the step timed
    outside the profiler's own bookkeeping) and the trace file if ``trace_dir`` is given.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if strategy == "single" and world_size != 1:
        raise ValueError("strategy 'single' runs on one rank: use world_size=1")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if world_size < 1 or batch_size < 1 or grad_accum < 1 or warmup < 0:
        raise ValueError("world_size, batch_size and grad_accum must be >= 1, warmup >= 0")
    # the launcher's decision: one rank per GPU over NCCL, or ranks sharing the GPUs over gloo
    plan = plan_ranks(torch.cuda.device_count() if device == "cuda" else 0, world_size, device)
    gpt = {"block_size": 64, "vocab_size": 65, "n_layer": 2, "n_head": 4, "n_embd": 128, "dropout": 0.0,
           **(gpt or {})}
    if trace_dir is not None:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
    spec = {"strategy": strategy, "gpt": gpt, "batch_size": batch_size, "grad_accum": grad_accum,
            "warmup": warmup, "trace_dir": str(trace_dir) if trace_dir is not None else None,
            "devices": plan.devices, "strategy_kwargs": strategy_kwargs}
    results = run_ranks(profile_worker, world_size, spec, backend=plan.backend, threads=threads,
                        start_method="spawn" if device == "cuda" else None)  # a forked child cannot use CUDA
    if trace_dir is not None:
        merge_traces([r["trace"] for r in results], Path(trace_dir) / "trace.json")
    return results


# ------------------------------------------------------------------ showing it

def step_time_table(results: list[dict]):
    """A pandas DataFrame, one row per rank, of the times in :func:`classify_events` (ms)."""
    import pandas as pd  # here, not at the top: every spawned rank imports this module

    cols = ["step_ms", "compute_ms", "comm_ms", "overlap_ms", "exposed_comm_ms", "other_ms"]
    return pd.DataFrame([{"rank": r["rank"], "strategy": r["strategy"], **{c: r[c] for c in cols}}
                         for r in results]).set_index("rank")


def merge_traces(paths: list[str | os.PathLike], out: str | os.PathLike) -> Path:
    """One Chrome trace holding every rank's (rank r as process r, named "rank r")."""
    traces = [json.loads(Path(p).read_text()) for p in paths]
    # each process counts ts from its own base; shift them onto the earliest base (same clock)
    bases = [t.get("baseTimeNanoseconds", 0) for t in traces]
    events = []
    for rank, (trace, base) in enumerate(zip(traces, bases)):
        shift = (base - min(bases)) / 1e3  # us
        for e in trace.get("traceEvents", []):
            e = dict(e, pid=rank)
            if "ts" in e and shift:
                e["ts"] = float(e["ts"]) + shift
            events.append(e)
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    out = Path(out)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out
