"""Helpers for graded exercises: run a notebook function on N gloo ranks, never hang, compare.

    from course_lib.exercises.grading import run_ranks, assert_close, p2p_only
    results = run_ranks(fn, 2)          # fn(rank, world_size) on 2 ranks -> [value of rank 0, 1]

Students call :func:`run_ranks` in the exercise notebooks to try their multi-rank code; the
exercises' tests call it too, and compare what the ranks return with a single-process
reference (:func:`assert_close`). The ranks are forked from the calling process (the notebook's
kernel) by course_lib's notebook launcher, so ``fn`` may be defined in the notebook or inside a
test function; values come back pickled.

A wrong answer must never stall grading: every collective has a timeout
(``COURSE_GRADING_TIMEOUT`` seconds, default 60, or ``timeout=``) and the whole run a wall-clock
limit, after which the ranks are stopped and :class:`RanksTimeoutError` says what happened. A
rank that raises or exits while others wait for it stops the run with :class:`RankError`.
:func:`p2p_only` lets a test forbid the library collectives and count the bytes a rank sends.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "COURSE_GRADING_TIMEOUT"
MAX_RANKS = 8


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


class RanksTimeoutError(TimeoutError):
    """Some ranks did not finish in time (a collective or a receive another rank never joined)."""


def default_timeout() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be > 0 seconds, got {value!r}")
    return seconds


def _with_rank(fn, args):
    """What each rank runs: the exercises' functions take (rank, world_size, *args)."""
    import torch.distributed as dist

    return fn(dist.get_rank(), dist.get_world_size(), *args)


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any, timeout: float | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` gloo ranks forked from this process
    (course_lib's :func:`~course_lib.launch.forked.notebook_launcher`); return their values.

    ``timeout`` (default ``COURSE_GRADING_TIMEOUT`` or 60 s) bounds every collective; the whole
    call gets 1.5 x timeout + 5 s of wall clock. Raises :class:`RanksTimeoutError` when ranks
    hang, :class:`RankError` when a rank raises or dies.
    """
    from course_lib.launch.checks import LaunchConfigError
    from course_lib.launch.forked import NotebookLaunchError, notebook_launcher

    if not callable(fn):
        raise TypeError(f"run_ranks needs a function fn(rank, world_size, ...), got {fn!r}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= MAX_RANKS:
        raise ValueError(f"nproc must be a whole number from 1 to {MAX_RANKS}, got {nproc!r}")
    timeout = default_timeout() if timeout is None else float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    import torch.distributed  # noqa: F401 - imported once here, the forked ranks inherit it

    start = time.monotonic()
    try:
        return notebook_launcher(_with_rank, (fn, args), nproc=nproc, timeout=timeout,
                                 time_limit=1.5 * timeout + 5)
    except LaunchConfigError:
        raise
    except NotebookLaunchError as e:
        message, elapsed = str(e), time.monotonic() - start
        # When one rank's collective times out it exits, and the ranks still waiting on it see
        # their connection close: which report arrives first is a race, so judge by the clock.
        if "time limit" in message or "timed out" in message or elapsed >= timeout:
            raise RanksTimeoutError(f"the {nproc} ranks did not finish within {timeout:g} s (is "
                                    "there a collective or a receive that some rank never joined?)"
                                    f"\n{message}") from None
        raise RankError(message + (f"\n{e.traceback}" if e.traceback else "")) from None


# --------------------------------------------------------------------------------------------
# Comparing with a reference
# --------------------------------------------------------------------------------------------

def assert_close(actual, expected, what: str = "result", atol: float = 1e-6, rtol: float = 1e-5) -> None:
    """Assert two tensors (or equally long lists of tensors) match; the message says where not."""
    import torch

    if isinstance(expected, torch.Tensor):
        actual, expected = [actual], [expected]
    actual, expected = list(actual), list(expected)
    if len(actual) != len(expected):
        raise AssertionError(f"{what}: {len(actual)} tensors, expected {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        if not isinstance(a, torch.Tensor):
            # a failed check like the others below, not a caller's type error
            raise AssertionError(f"{what}: item {i} is {type(a).__name__}, expected a tensor")  # noqa: TRY004
        e = e.detach()
        if a.shape != e.shape:
            raise AssertionError(f"{what}: item {i} has shape {tuple(a.shape)}, expected {tuple(e.shape)}")
        a = a.detach().to(e.dtype)
        if not torch.allclose(a, e, atol=atol, rtol=rtol):
            err = (a - e).abs().max().item()
            raise AssertionError(f"{what}: item {i} differs by up to {err:.3g} (allowed {atol:g} + {rtol:g} x |expected|)")


# --------------------------------------------------------------------------------------------
# Point-to-point only, with a byte count
# --------------------------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_to_all", "all_to_all_single", "all_gather_object", "broadcast_object_list",
               "gather", "scatter")


@dataclass
class Sent:
    """What this rank sent point-to-point inside :func:`p2p_only`."""

    bytes: int = 0
    messages: int = 0


@contextlib.contextmanager
def p2p_only():
    """Inside, this rank may only use point-to-point sends and receives: the library collectives
    raise, and ``send``/``isend`` (also through ``batch_isend_irecv``) are counted in the
    yielded :class:`Sent`. Restores ``torch.distributed`` on exit."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    sent = Sent()
    # dist re-exports c10d's functions; P2POp and batch_isend_irecv look them up in c10d
    saved = [(mod, name, getattr(mod, name)) for mod in (dist, c10d)
             for name in COLLECTIVES + ("send", "isend") if hasattr(mod, name)]

    def forbidden(name):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"dist.{name} is not allowed here: use point-to-point "
                               "dist.send/dist.isend and dist.recv/dist.irecv only")
        return refuse

    depth = [0]  # send() may be built on isend(): count the outermost call only

    def counted(original):
        def send(tensor, *args, **kwargs):
            if depth[0] == 0:
                sent.bytes += tensor.numel() * tensor.element_size()
                sent.messages += 1
            depth[0] += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                depth[0] -= 1
        return send

    replacements = {name: forbidden(name) for name in COLLECTIVES}
    replacements["send"], replacements["isend"] = counted(c10d.send), counted(c10d.isend)
    try:
        for mod, name, _ in saved:
            setattr(mod, name, replacements[name])
        yield sent
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
