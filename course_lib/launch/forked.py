"""notebook_launcher(fn, args, nproc=2): run a function defined in the notebook on N processes.

    def step(scale):
        t = torch.full((2,), float(dist.get_rank() + 1)) * scale
        dist.all_reduce(t)
        return t
    results = notebook_launcher(step, (10.0,), nproc=2)   # [tensor([30., 30.]), tensor([30., 30.])]

The course's one way to run a function on N local ranks is :func:`course_lib.launch.spawn.run_ranks`
(``run_ranks(fn, nproc, *args)``, ``fn(rank, world_size, *args)``); this is the same runner under
the name and calling convention of accelerate's ``notebook_launcher`` (``fn(*args)``, the rank
from the environment), kept as a documented alias for code written against accelerate.

For short CPU exercises (the idea of accelerate's notebook_launcher), a front-end of the one
local rank runner, :func:`course_lib.launch.ranks.run_local`: the ranks start from a clean fork
server, not from the kernel, so they work whatever the kernel did before (CUDA initialised, a
backward run, threads started); the function and its arguments are sent by value, so a function
defined in a cell works, and what cannot be sent is named before anything starts. Each rank gets
RANK, WORLD_SIZE, LOCAL_RANK, the default process group (gloo, with a collective timeout) and
its share of the CPU threads; its printed lines come back prefixed ``[rankN]``; rank k's return
value is ``results[k]``. A failure in any rank stops the others and raises
:class:`NotebookLaunchError` naming the rank, with its traceback and a hint (a collective that
timed out, a peer that exited). The ranks are CPU processes: for GPU ranks use a ``%%torchrun``
cell.
"""

from __future__ import annotations

import sys

from course_lib.hardware import threads_per_rank
from course_lib.launch.bootstrap import diagnose
from course_lib.launch.placement import LaunchConfigError
from course_lib.launch.ranks import RankError, RanksTimeoutError, run_local
from course_lib.utils import check_count, check_seconds, traceback_to_caller


class NotebookLaunchError(RuntimeError):
    """A rank failed or the ranks ran out of time; the failing rank's traceback was printed above."""

    def __init__(self, message: str, rank: int | None = None, traceback_text: str | None = None):
        super().__init__(message)
        self.rank, self.traceback = rank, traceback_text

    _render_traceback_ = traceback_to_caller  # ends at the notebook's call, not in notebook_launcher


CUDA_HINT = ("notebook_launcher's ranks are CPU processes (gloo); for GPU ranks put the code in a "
             "%%torchrun cell (separate processes, one GPU each).")


def notebook_launcher(fn, args: tuple = (), nproc: int = 2, *, kwargs: dict | None = None,
                      backend: str = "gloo", timeout: float = 60.0, time_limit: float | None = None,
                      threads: int | None = None) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nproc`` processes; return their results by rank.

    timeout: collective timeout of the process group, seconds. time_limit: wall clock of the
    run, from the moment every rank has joined the group (None: none). threads: torch threads
    per process (default: cores // nproc).
    """
    __tracebackhide__ = True  # the runner's own frame: a notebook's traceback ends at the caller
    if not callable(fn):
        raise LaunchConfigError(f"fn must be a function, got {type(fn).__name__}")
    check_count("nproc", nproc, error=LaunchConfigError)
    if backend != "gloo":
        raise LaunchConfigError(f"notebook_launcher runs on CPU with backend='gloo' (got {backend!r}); "
                                "use %%torchrun or launch() for NCCL on GPUs")
    check_seconds("timeout", timeout, False, LaunchConfigError)
    check_seconds("time_limit", time_limit, error=LaunchConfigError)
    if threads is not None:  # 0 is not "the default": None is
        check_count("threads", threads, error=LaunchConfigError)
    try:
        return run_local(fn, nproc, args, kwargs, timeout=timeout, time_limit=time_limit,
                         threads=threads if threads is not None else threads_per_rank(nproc))
    except RanksTimeoutError as e:
        raise NotebookLaunchError(str(e)) from None
    except RankError as e:
        sys.stderr.write(e.traceback)
        _, hint = diagnose(e.what, "run", timeout)
        if "CUDA" in e.what and not hint:
            hint = CUDA_HINT
        more = f"\nranks still running (did not join?): {e.waiting}" if hint and e.waiting else ""
        raise NotebookLaunchError(f"rank {e.rank} failed: {e.what}" + (f"\n{hint}" if hint else "") + more,
                                  e.rank, e.traceback) from None
