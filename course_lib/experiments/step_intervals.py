"""A profiled training step as time intervals: computation, communication, both, neither.

:mod:`course_lib.experiments.profiling` records one step per rank with ``torch.profiler``; the
recorded events (dicts: name, thread, start, end in us, device) are sorted here into two kinds
of time intervals:

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

Plain interval arithmetic on the events: this module imports neither torch nor matplotlib.
"""

from __future__ import annotations

import re

COMM_EVENT = re.compile(r"^(gloo:|nccl:|c10d::|record_param_comms)|^nccl(Dev)?Kernel", re.IGNORECASE)
COMPUTE_EVENT = re.compile(r"^(aten::|autograd::engine::evaluate_function|Optimizer\.)")
STEP_PHASES = ("forward", "backward", "pipeline", "finish_grads", "clip_grad_norm", "optimizer_step", "zero_grad")
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

def classify_events(events: list[dict]) -> dict:
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
              for e in inside if e["thread"] == main and e["name"] in STEP_PHASES}
    return {
        "step_ms": step_us * ms, "compute_ms": total(compute) * ms, "comm_ms": total(comm) * ms,
        "overlap_ms": total(overlap) * ms, "exposed_comm_ms": (total(comm) - total(overlap)) * ms,
        "other_ms": (step_us - busy) * ms, "device": "cuda" if gpu else "cpu",
        "compute": [(s * ms, e * ms) for s, e in compute], "comm": [(s * ms, e * ms) for s, e in comm],
        "phases": phases,
    }
