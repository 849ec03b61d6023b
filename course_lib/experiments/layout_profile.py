"""One training step of a dp x pp x cp x tp layout, profiled on every rank (notebook 10).

    from course_lib.experiments.layout_profile import profile_layout
    from course_lib.experiments.profiling import step_time_table
    from course_lib.notebook.plots import plot_step_timeline
    ranks = profile_layout(tp=2, pp=2)          # 4 gloo processes
    plot_step_timeline(ranks)                   # compute and communication lanes, rank by rank

The step is the trainer's under :class:`~course_lib.parallel.model_parallel.ModelParallel`: the
pipeline's forward/backward schedule (every tp, sp, cp and pp message inside it), finish_grads,
global-norm clipping, the optimizer step. The events are sorted into compute and communication
by :func:`course_lib.experiments.step_intervals.classify_events`: a pipeline stage waiting for its neighbour
shows as communication on the critical path (the bubble), a tp all-reduce as a short stall in
every layer.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from course_lib.experiments.profiling import LABELS, _events, labelled
from course_lib.experiments.step_intervals import STEP, classify_events
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.parallelize import parallelize
from course_lib.parallel.step import train_step


def profile_layout_worker(rank: int, world_size: int, spec: dict) -> dict:
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's library is quiet
    lay = spec["layout"]
    torch.manual_seed(0)
    cfg = GPTConfig(**spec["gpt"])
    strategy = parallelize(GPT(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), spec["strategy"],
                           tp=lay["tp"], pp=lay["pp"], cp=lay["cp"], sequence_parallel=lay["sequence_parallel"],
                           pp_schedule=lay["pp_schedule"], model_parallel=True)
    grid = strategy.grid
    gen = torch.Generator().manual_seed(1 + grid.dp_rank)  # one batch per dp rank, shared by its tp/pp/cp ranks
    x = torch.randint(cfg.vocab_size, (spec["grad_accum"], spec["batch_size"], cfg.block_size), generator=gen)

    # "pipeline": the whole schedule, forwards and backwards interleaved
    names = {**LABELS, "forward_backward": "pipeline"}

    def step(label=lambda name: nullcontext()):
        train_step(strategy, x, x.roll(-1, dims=-1), grad_clip=1.0, phase=labelled(label, names))

    for _ in range(spec["warmup"]):
        step()
    torch.distributed.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        with record_function(STEP):
            step(record_function)
        wall_ms = 1e3 * (time.perf_counter() - t)
    result = classify_events(_events(prof))
    name = "-".join(f"{k}{lay[k]}" for k in ("tp", "pp", "cp") if lay[k] > 1)
    result.update(rank=rank, world_size=world_size, strategy=name or spec["strategy"], wall_ms=wall_ms)
    return result


def profile_layout(world_size: int = 4, tp: int = 1, pp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                   pp_schedule: str = "1f1b", strategy: str = "ddp", gpt: dict | None = None, batch_size: int = 4,
                   grad_accum: int = 4, warmup: int = 1) -> list[dict]:
    """Profile one step of the layout on ``world_size`` gloo ranks (dp = the rest); one dict per rank
    (what :func:`~course_lib.experiments.step_intervals.classify_events` returns, plus rank and wall_ms)."""
    if world_size % (tp * pp * cp):
        raise ValueError(f"world_size {world_size} is not divisible by tp*pp*cp = {tp * pp * cp}")
    gpt = {"block_size": 64, "vocab_size": 65, "n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0, **(gpt or {})}
    spec = {"layout": {"tp": tp, "pp": pp, "cp": cp, "sequence_parallel": sequence_parallel, "pp_schedule": pp_schedule},
            "strategy": strategy, "gpt": gpt, "batch_size": batch_size, "grad_accum": grad_accum, "warmup": warmup}
    return run_ranks(profile_layout_worker, world_size, spec)
