"""Run a function on N local processes joined in a process group (tests, notebooks, benchmarks).

    from course_lib.parallel.spawn import run_ranks
    results = run_ranks(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> value

Each worker sets ``OMP_NUM_THREADS`` (default 1, so N workers do not oversubscribe the cores),
joins a gloo (or NCCL) process group on a free local port, runs ``fn`` and returns its value to
the parent, where ``results[r]`` is rank r's. An exception in any worker is raised in the parent.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from course_lib.utils import free_port


def _worker(rank: int, fn, world_size: int, args: tuple, backend: str, port: int,
            out_dir: str, threads: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    kwargs = {}
    if backend == "nccl":  # one GPU per rank (run_ranks checked there are enough)
        torch.cuda.set_device(rank)
        # device_id binds the communicator to this rank's GPU (no guessing in barrier())
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, **kwargs)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        if dist.is_initialized():  # fn may have ended the group itself (the trainer does)
            dist.destroy_process_group()


def default_start_method(backend: str) -> str:
    """The start method: "fork" where the OS has it, except for NCCL ranks once this process initialised CUDA
    (a forked child cannot use it). gloo ranks are CPU processes: they fork even then, as
    PyTorch's DataLoader workers do, so that a 1-GPU notebook (Colab) still runs CPU demos."""
    if "fork" not in mp.get_all_start_methods():
        return "spawn"
    return "spawn" if backend == "nccl" and torch.cuda.is_initialized() else "fork"


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), backend: str = "gloo",
              threads: int = 1, start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results.

    ``start_method`` "fork" (the default where the OS has it; see :func:`default_start_method`)
    starts workers in milliseconds, with everything the parent imported, and accepts functions
    defined in a notebook; "spawn" starts fresh interpreters (about 2 s each to import torch) and
    needs ``fn`` importable from a module.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (one GPU per rank), got {backend!r}")
    if backend == "nccl":
        gpus = torch.cuda.device_count()  # asks NVML: no CUDA context in the parent
        if gpus < world_size:
            raise ValueError(f"NCCL needs one GPU per rank: {world_size} ranks, {gpus} GPU(s) "
                             "here; use backend='gloo' or fewer ranks")
    if start_method is None:
        start_method = default_start_method(backend)
    if start_method == "fork":
        # Optimizers import torch._dynamo lazily (1-2 s): once here, not once per worker.
        importlib.import_module("torch._dynamo")
    with tempfile.TemporaryDirectory(prefix="course_ranks_") as out_dir:
        mp.start_processes(_worker, nprocs=world_size, join=True, start_method=start_method,
                           args=(fn, world_size, args, backend, free_port(), out_dir, threads))
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]
