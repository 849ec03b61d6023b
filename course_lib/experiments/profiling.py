"""Where one training step's time goes on each rank: computation, communication, both, neither.

    from course_lib.experiments.profiling import profile_step, step_table, plot_step_timeline
    ranks = profile_step("ddp", world_size=2, trace_dir="runs/trace")  # 2 gloo processes
    step_table(ranks)           # per rank: step, compute, comm, overlap, exposed comm, other (ms)
    plot_step_timeline(ranks)   # the step drawn as a timeline, one pair of lanes per rank

Each rank builds the same GPT, wraps it in a trainer Strategy (course_lib.parallel.strategy),
runs a few warm-up steps, then records one step (the trainer's: micro-batches with no_sync,
finish_grads, global-norm clipping, optimizer step, zero_grad) with ``torch.profiler``. The
recorded events are sorted into two kinds of time intervals:

* **compute**: operators running on the rank's main thread (``aten::`` ops, autograd's
  backward functions, the optimizer), or CUDA kernels other than NCCL's on a GPU;
* **communication**: collectives in flight: gloo runs them on its own threads (events named
  ``gloo:all_reduce`` ...), NCCL as kernels (``ncclDevKernel_...``); the main thread's
  ``c10d::`` calls that start them count too. A collective's interval includes the time spent
  waiting for the slowest rank to join: for the step that is communication time as well.

From the two sets of intervals (each merged, so nested or parallel events count once):
``overlap`` is communication hidden behind computation, ``exposed`` the communication the step
waits for, and ``other`` what is neither (Python between operators, launching work, the
profiler's own cost). compute + exposed + other = the step. Waiting for a collective shows no
operator on the main thread, which is how the exposed part is found.

``trace_dir`` keeps each rank's Chrome trace (``rank{r}.json``) and one merged file
(``trace.json``, rank r as process r) to open in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
import re
import time
from contextlib import nullcontext
from pathlib import Path

COMM_EVENT = re.compile(r"^(gloo:|nccl:|c10d::|record_param_comms)|^nccl(Dev)?Kernel", re.IGNORECASE)
COMPUTE_EVENT = re.compile(r"^(aten::|autograd::engine::evaluate_function|Optimizer\.)")
PHASES = ("forward", "backward", "pipeline", "finish_grads", "clip_grad_norm", "optimizer_step", "zero_grad")
STEP = "train_step"


# ------------------------------------------------------------------ interval arithmetic

def merge(intervals) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of (start, end) intervals."""
    out: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def total(intervals) -> float:
    return sum(e - s for s, e in merge(intervals))


def intersect(a, b) -> list[tuple[float, float]]:
    """Intersection of two unions of intervals."""
    a, b, out, i, j = merge(a), merge(b), [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[tuple[float, float]]:
    """``a`` minus ``b`` (both unions of intervals)."""
    out = []
    for s, e in merge(a):
        for bs, be in merge(b):
            if be <= s or bs >= e:
                continue
            if bs > s:
                out.append((s, bs))
            s = max(s, be)
            if s >= e:
                break
        if e > s:
            out.append((s, e))
    return out


# ------------------------------------------------------------------ classification

def classify(events: list[dict]) -> dict:
    """Sort one rank's profiled events (dicts: name, thread, start, end in us, device) into
    compute and communication intervals relative to the start of the step.

    Returns step_ms, compute_ms, comm_ms, overlap_ms, exposed_comm_ms, other_ms and the merged
    intervals (ms) under ``compute``, ``comm`` and ``phases`` (name -> interval) for plots.
    """
    steps = [e for e in events if e["name"] == STEP]
    if not steps:
        raise ValueError(f"no {STEP!r} event: profile a step wrapped in record_function({STEP!r})")
    step = steps[0]
    t0, t1, main = step["start"], step["end"], step["thread"]
    inside = [e for e in events if e["end"] > t0 and e["start"] < t1]

    def clip(e):
        return max(e["start"], t0) - t0, min(e["end"], t1) - t0

    gpu = any(e["device"] == "cuda" for e in inside)
    if gpu:  # what the GPU does: NCCL kernels communicate, every other kernel computes
        kernels = [e for e in inside if e["device"] == "cuda"]
        comm = [clip(e) for e in kernels if COMM_EVENT.search(e["name"])]
        compute = [clip(e) for e in kernels if not COMM_EVENT.search(e["name"])]
    else:
        comm = [clip(e) for e in inside if COMM_EVENT.search(e["name"])
                and (e["thread"] != main or e["name"].startswith("c10d::"))]
        launches = [clip(e) for e in inside if e["thread"] == main and COMM_EVENT.search(e["name"])]
        ops = [clip(e) for e in inside if e["thread"] == main and COMPUTE_EVENT.search(e["name"])]
        compute = subtract(ops, launches)  # e.g. an all-gather's copies inside FSDP's hooks
    compute, comm = merge(compute), merge(comm)
    overlap = intersect(compute, comm)
    step_us = t1 - t0
    busy = total(compute) + total(comm) - total(overlap)
    ms = 1e-3
    phases = {e["name"]: (clip(e)[0] * ms, clip(e)[1] * ms)
              for e in inside if e["thread"] == main and e["name"] in PHASES}
    return {
        "step_ms": step_us * ms, "compute_ms": total(compute) * ms, "comm_ms": total(comm) * ms,
        "overlap_ms": total(overlap) * ms, "exposed_comm_ms": (total(comm) - total(overlap)) * ms,
        "other_ms": (step_us - busy) * ms, "device": "cuda" if gpu else "cpu",
        "compute": [(s * ms, e * ms) for s, e in compute], "comm": [(s * ms, e * ms) for s, e in comm],
        "phases": phases,
    }


# ------------------------------------------------------------------ the profiled step (one rank)

def _events(prof) -> list[dict]:
    from torch.autograd import DeviceType

    return [{"name": e.name, "thread": e.thread, "start": e.time_range.start, "end": e.time_range.end,
             "device": "cuda" if e.device_type == DeviceType.CUDA else "cpu"} for e in prof.events()]


def finish_step(strategy, label) -> None:
    """The trainer's step after backward, each phase under ``label(name)`` (a record_function)."""
    with label("finish_grads"):
        strategy.finish_grads()
    with label("clip_grad_norm"):
        strategy.clip_grad_norm_(1.0)
    with label("optimizer_step"):
        strategy.step()
    with label("zero_grad"):
        strategy.zero_grad()


def profile_worker(rank: int, world_size: int, spec: dict) -> dict:
    """One rank of :func:`profile_step` (a module-level function, so "spawn" can start it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from course_lib.gpt.model import GPT, GPTConfig
    from course_lib.parallel.strategy import build_strategy

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # else the profiler's library logs every start and stop
    device = f"cuda:{rank}" if spec["device"] == "cuda" else "cpu"
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
        for micro in range(accum):
            with strategy.no_sync() if micro < accum - 1 else nullcontext():
                with label("forward"):
                    loss = strategy.model(x[micro], y[micro])[1] / accum
                with label("backward"):
                    loss.backward()
        finish_step(strategy, label)
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
    result = classify(_events(prof))
    result.update(rank=rank, world_size=world_size, strategy=spec["strategy"], wall_ms=wall_ms)
    if spec["trace_dir"]:
        path = Path(spec["trace_dir"]) / f"rank{rank}.json"
        prof.export_chrome_trace(str(path))
        result["trace"] = str(path)
    return result


def profile_step(strategy: str = "ddp", world_size: int = 2, gpt: dict | None = None, batch_size: int = 8,
                 grad_accum: int = 1, warmup: int = 2, trace_dir: str | os.PathLike | None = None,
                 device: str = "cpu", threads: int = 1, **strategy_kwargs) -> list[dict]:
    """Profile one training step of ``strategy`` on ``world_size`` local ranks; one dict per rank.

    gpt: GPTConfig fields (default: a 2-layer, 128-wide character model, block 64).
    device "cpu" uses gloo, "cuda" NCCL with one GPU per rank. ``strategy_kwargs`` go to the
    strategy (e.g. ``bucket_cap_mb=0.1`` for ddp: several buckets, so communication overlaps
    backward). The results say what :func:`classify` says, plus wall_ms (the step timed
    outside the profiler's own bookkeeping) and the trace file if ``trace_dir`` is given.
    """
    from course_lib.parallel.spawn import run_ranks
    from course_lib.parallel.strategy import STRATEGIES

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if strategy == "single" and world_size != 1:
        raise ValueError("strategy 'single' runs on one rank: use world_size=1")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < world_size:
            raise ValueError(f"{world_size} ranks need {world_size} GPUs; "
                             f"{torch.cuda.device_count()} visible (use device='cpu')")
    if world_size < 1 or batch_size < 1 or grad_accum < 1 or warmup < 0:
        raise ValueError("world_size, batch_size and grad_accum must be >= 1, warmup >= 0")
    gpt = {"block_size": 64, "vocab_size": 65, "n_layer": 2, "n_head": 4, "n_embd": 128, "dropout": 0.0,
           **(gpt or {})}
    if trace_dir is not None:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
    spec = {"strategy": strategy, "gpt": gpt, "batch_size": batch_size, "grad_accum": grad_accum,
            "warmup": warmup, "trace_dir": str(trace_dir) if trace_dir is not None else None,
            "device": device, "strategy_kwargs": strategy_kwargs}
    results = run_ranks(profile_worker, world_size, args=(spec,), backend="nccl" if device == "cuda" else "gloo",
                        threads=threads)
    if trace_dir is not None:
        merge_traces([r["trace"] for r in results], Path(trace_dir) / "trace.json")
    return results


# ------------------------------------------------------------------ showing it

def step_table(results: list[dict]):
    """A pandas DataFrame, one row per rank, of the times in :func:`classify` (ms)."""
    import pandas as pd

    cols = ["step_ms", "compute_ms", "comm_ms", "overlap_ms", "exposed_comm_ms", "other_ms"]
    return pd.DataFrame([{"rank": r["rank"], "strategy": r["strategy"], **{c: r[c] for c in cols}}
                         for r in results]).set_index("rank")


def plot_step_timeline(results: list[dict], title: str | None = None, ax=None):
    """The profiled step of every rank: a lane of phases, one of compute, one of communication."""
    if ax is None:
        from matplotlib.figure import Figure  # no pyplot: no global figure state

        ax = Figure(figsize=(9, 0.6 + 1.2 * len(results)), layout="constrained").add_subplot()
    colors = {"compute": "#4c72b0", "comm": "#dd8452"}
    shades = ("#e0e0e0", "#c8c8c8")
    ticks, labels = [], []
    for k, r in enumerate(results):
        base = 4 * (len(results) - 1 - k)  # rank 0 on top
        width = max(r["step_ms"], 1e-9)
        for i, (name, (s, e)) in enumerate(sorted(r["phases"].items(), key=lambda p: p[1][0])):
            ax.broken_barh([(s, e - s)], (base + 2 - 0.4, 0.8), color=shades[i % 2])
            if e - s > 0.06 * width:  # a label only where it fits
                ax.text((s + e) / 2, base + 2, name, ha="center", va="center", fontsize=7)
        for lane, kind in enumerate(("compute", "comm")):
            y = base + 1 - lane
            ax.broken_barh([(s, e - s) for s, e in r[kind]], (y - 0.4, 0.8), color=colors[kind],
                           label=kind if k == 0 else None)
        ticks += [base + 2, base + 1, base]
        labels += [f"rank {r['rank']} phases", "compute", "comm"]
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("ms since the step started (each rank's own clock)")
    ax.set_title(title or f"one step of {results[0]['strategy']} on {len(results)} ranks")
    ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, -0.12), ncol=2)
    ax.set_ylim(-0.7, 4 * len(results) - 1.3)
    return ax.figure


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
