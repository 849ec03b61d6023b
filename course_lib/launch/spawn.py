"""Run a function on N local processes joined in a process group (tests, notebooks, benchmarks,
graded exercises): the course's ``run_ranks``.

    from course_lib.launch.spawn import run_ranks
    results = run_ranks(fn, 2, x, y)           # fn(rank, world_size, x, y) on 2 ranks -> [value of rank 0, 1]
    results = run_ranks(fn, 2, timeout=10)     # never longer than ~10 s + start-up

The one signature for running a function on N local ranks, the same as the exercises'
:func:`course_lib.exercises.grading.run_ranks` (the grader's copy, with its own time limit);
:func:`course_lib.launch.forked.notebook_launcher` is the same runner under accelerate's name
and calling convention (``fn(*args)``, ``nproc=``), and :class:`course_lib.launch.rank_pool.RankPool`
the persistent one (ranks that live across cells).

A front-end of the one local rank runner, :func:`course_lib.launch.ranks.run_local`: the ranks
start from a clean fork server, not from this process (so CUDA, autograd's threads or any other
thread here do no harm), ``fn`` and ``args`` travel by value (a function defined in a notebook
works), each rank uses ``threads`` CPU threads (default 1, so N ranks do not oversubscribe the
cores), joins a gloo (or NCCL) group met in a file store, passes a barrier, runs ``fn`` and
returns its value: ``results[r]`` is rank r's. A rank that raises stops the run with
:class:`RankError` (its traceback in the message). With ``timeout`` every collective times out
after that many seconds and the run gets ``timeout + 5`` s of wall clock, after which the ranks
are killed and :class:`RanksTimeoutError` names the ranks that never finished: a receive or a
collective that some rank never joined becomes an error, not a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from course_lib.launch.bootstrap import diagnose
from course_lib.launch.ranks import RankError, RanksTimeoutError, SendError, run_local
from course_lib.utils import check_count, check_seconds

__all__ = ["TIMEOUT_GRACE_S", "RankError", "RanksTimeoutError", "SendError", "run_ranks"]

TIMEOUT_GRACE_S = 5.0  # wall clock beyond the collective timeout: reporting the timeout


def _hang_message(world_size: int, timeout: float, stuck: list[int], detail: str = "") -> str:
    who = f"; rank {', '.join(map(str, stuck))} still waiting" if stuck else ""
    return (f"the {world_size} ranks did not finish within {timeout:g} s (is there a collective or "
            f"a receive that some rank never joined?){who}" + (f"\n{detail}" if detail else ""))


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any, backend: str = "gloo", threads: int = 1,
              start_method: str | None = None, timeout: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` processes; return their results by rank.

    ``timeout`` (seconds, default none) bounds every collective and, plus 5 s, the run.
    ``start_method``: leave it to the runner ("forkserver", or "spawn" where there is none);
    "fork" only to measure what it costs (benchmarks/rank_start.py): it inherits this
    process's state. Raises :class:`SendError` when ``fn`` or ``args`` cannot be sent.
    """
    __tracebackhide__ = True  # the runner's own frame: a notebook's traceback ends at the caller
    check_count("nproc", nproc)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (one GPU per rank), got {backend!r}")
    timeout = check_seconds("timeout", timeout)
    if backend == "nccl":
        # torch only to count GPUs for NCCL: a gloo run needs no torch in the parent
        import torch

        gpus = torch.cuda.device_count()  # asks NVML: no CUDA context in the parent
        if gpus < nproc:
            raise ValueError(f"NCCL needs one GPU per rank: {nproc} ranks, {gpus} GPU(s) "
                             "here; use backend='gloo' or fewer ranks")
    limit = None if timeout is None else timeout + TIMEOUT_GRACE_S
    try:
        return run_local(fn, nproc, args, backend=backend, pass_rank=True, timeout=timeout,
                         time_limit=limit, threads=threads, method=start_method)
    except RanksTimeoutError as e:
        if e.phase == "start":
            raise
        raise RanksTimeoutError(_hang_message(nproc, timeout, e.stuck), e.stuck) from None
    except RankError as e:
        # When one rank's collective times out it raises, and the ranks still waiting on it see
        # their connection close: which report arrives first is a race, so judge by the clock. Only
        # a collective's failure (timed out, or a peer gone) is a hang: a ValueError raised after
        # ``timeout`` seconds of computing is the student's ValueError.
        if timeout is not None and e.elapsed >= timeout and diagnose(e.what, "run", timeout)[0] != "error":
            stuck = e.waiting or [e.rank]
            raise RanksTimeoutError(_hang_message(nproc, timeout, stuck, str(e)), stuck) from None
        raise
