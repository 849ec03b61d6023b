"""Run a function on N local processes joined in a process group (tests, notebooks, benchmarks,
graded exercises): the one ``run_ranks`` of the course.

    from course_lib.parallel.spawn import run_ranks
    results = run_ranks(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> value
    results = run_ranks(fn, 2, timeout=10)               # never longer than ~10 s + start-up

Each worker sets ``OMP_NUM_THREADS`` (default 1, so N workers do not oversubscribe the cores),
joins a gloo (or NCCL) process group (meeting in a file store of its own, no port), runs ``fn``
and returns its value to the parent, where ``results[r]`` is rank r's. A rank that raises stops the run with
:class:`RankError` (its traceback in the message). With ``timeout`` every collective of the group
times out after that many seconds and the whole call gets ``timeout + 5`` s of wall clock, after
which the ranks are killed and :class:`RanksTimeoutError` names the ranks that never finished:
a receive or a collective that some rank never joined becomes an error, not a hang.
"""

from __future__ import annotations

import importlib
import os
import signal
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException


GRACE_S = 5.0  # wall clock beyond the collective timeout: start-up, reporting the timeout


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


class RanksTimeoutError(TimeoutError):
    """Some ranks did not finish in time (a collective or a receive another rank never joined)."""


def _worker(rank: int, fn, world_size: int, args: tuple, backend: str, init_method: str,
            out_dir: str, threads: int, timeout: float | None) -> None:
    # The parent died (a killed grader, a closed notebook): do not linger as an orphan.
    from course_lib.launch.procs import reset_locks_after_fork, set_parent_death_signal  # only workers need it

    set_parent_death_signal(signal.SIGKILL)
    reset_locks_after_fork()  # a forked rank must not inherit a lock another thread held
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    kwargs = {}
    if backend == "nccl":  # one GPU per rank (run_ranks checked there are enough)
        torch.cuda.set_device(rank)
        # device_id binds the communicator to this rank's GPU (no guessing in barrier())
        kwargs["device_id"] = torch.device("cuda", rank)
    if timeout is not None:
        kwargs["timeout"] = timedelta(seconds=timeout)
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, **kwargs)
    # gloo's init returns on a rank once its own connections are up; a rank whose fn is quick
    # could then exit and close them while a peer still completes its handshake with it
    # ("connectFullMesh failed: Connection closed by peer"): everyone is connected before fn runs.
    dist.barrier()
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


def _stop(context) -> None:
    for p in context.processes:
        if p.is_alive():
            p.kill()
    for p in context.processes:
        p.join(5.0)


def _hang_message(world_size: int, timeout: float, stuck: list[int], detail: str = "") -> str:
    who = f"; rank {', '.join(map(str, stuck))} still waiting" if stuck else ""
    return (f"the {world_size} ranks did not finish within {timeout:g} s (is there a collective or "
            f"a receive that some rank never joined?){who}" + (f"\n{detail}" if detail else ""))


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), backend: str = "gloo",
              threads: int = 1, start_method: str | None = None,
              timeout: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results.

    ``start_method`` "fork" (the default where the OS has it; see :func:`default_start_method`)
    starts workers in milliseconds, with everything the parent imported, and accepts functions
    defined in a notebook; "spawn" starts fresh interpreters (about 2 s each to import torch) and
    needs ``fn`` importable from a module. ``timeout`` (seconds, default none) bounds every
    collective and, plus 5 s, the whole call.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r} (a whole number of ranks)")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (one GPU per rank), got {backend!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
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
        # The ranks meet in a file of their own (a FileStore), not on a TCP port: a port found
        # free can be taken by another process before rank 0 binds it.
        store = f"file://{Path(out_dir) / 'store'}"
        context = mp.start_processes(
            _worker, nprocs=world_size, join=False, start_method=start_method,
            args=(fn, world_size, args, backend, store, out_dir, threads, timeout))
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout + GRACE_S
        try:
            while not context.join(timeout=0.1):
                if deadline is not None and time.monotonic() > deadline:
                    stuck = [r for r, p in enumerate(context.processes) if p.is_alive()]
                    raise RanksTimeoutError(_hang_message(world_size, timeout, stuck))
        except ProcessException as e:
            # When one rank's collective times out it raises, and the ranks still waiting on it
            # see their connection close: which report arrives first is a race, so judge by the
            # clock.
            if timeout is not None and time.monotonic() - start >= timeout:
                stuck = [r for r, p in enumerate(context.processes) if p.is_alive() or r != e.error_index]
                raise RanksTimeoutError(_hang_message(world_size, timeout, stuck, str(e))) from None
            raise RankError(f"rank {e.error_index} failed:\n{e}") from None
        finally:
            _stop(context)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]
