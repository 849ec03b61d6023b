"""Helpers for graded exercises: run a notebook function on N gloo ranks, never hang, compare.

    from course_lib.grading import run_ranks, assert_close, p2p_only
    results = run_ranks(fn, 2)          # fn(rank, world_size) on 2 ranks -> [value of rank 0, 1]

Students call :func:`run_ranks` in the exercise notebooks to try their multi-rank code; the
exercises' tests call it too, and compare what the ranks return with a single-process
reference (:func:`assert_close`). A wrong answer must never stall grading: every run has a
timeout (``COURSE_GRADING_TIMEOUT`` seconds, default 60, or ``timeout=``), after which the ranks
are killed and :class:`RanksTimeoutError` says which ranks were stuck. A rank that raises stops
the run at once with :class:`RankError` carrying its traceback.

The ranks are forked from the calling process (the notebook's kernel), so ``fn`` may be defined
in the notebook or inside a test function; values come back pickled. Forking after CUDA has been
initialised is unsafe, so that is refused with an explanation.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

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


def _check(fn, nproc, timeout) -> float:
    if not callable(fn):
        raise TypeError(f"run_ranks needs a function fn(rank, world_size, ...), got {fn!r}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= MAX_RANKS:
        raise ValueError(f"nproc must be a whole number from 1 to {MAX_RANKS}, got {nproc!r}")
    timeout = default_timeout() if timeout is None else float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError("CUDA is already initialised in this process, and forked ranks cannot "
                           "use it: restart the kernel and run the multi-rank cells before any "
                           "cell that touches the GPU (these exercises run on CPU)")
    return timeout


def _rank_main(rank: int, world_size: int, port: int, timeout: float, fn, args, conn) -> None:
    """Body of a forked rank: join the group, run fn, send ('ok', value) or ('error', text).

    A rank that is done keeps its connections open until the parent stops every rank: a rank
    that returns early without joining a collective then leaves the others waiting, as it would
    in a real program, and the parent's timeout names them, instead of gloo reporting a closed
    connection. The group's own timeout is longer than the parent's, so the parent speaks first.
    """
    import datetime

    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout + 60))
        value = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps(("ok", value))
        except Exception as e:
            payload = pickle.dumps(("error", f"rank {rank} returned a value that cannot be sent "
                                             f"back to the notebook ({type(e).__name__}: {e})"))
    except BaseException:
        payload = pickle.dumps(("error", traceback.format_exc()))
    conn.send_bytes(payload)
    conn.close()
    while True:  # until the parent stops every rank (SIGKILL)
        time.sleep(3600)


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)  # a rank blocked in gloo ignores nothing else
    for p in procs:
        p.join(timeout=5)


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any, timeout: float | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` forked gloo ranks; return their values.

    Raises :class:`RanksTimeoutError` when some rank is still running after ``timeout`` seconds
    (default ``COURSE_GRADING_TIMEOUT`` or 60), :class:`RankError` when a rank raises.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    from course_lib.utils import free_port

    timeout = _check(fn, nproc, timeout)
    ctx = mp.get_context("fork")
    port = free_port()
    procs, conns = [], {}
    for rank in range(nproc):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(rank, nproc, port, timeout, fn, args, send),
                        name=f"rank{rank}", daemon=True)
        p.start()
        send.close()
        procs.append(p)
        conns[recv] = rank
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while conns:
            left = deadline - time.monotonic()
            ready = wait(list(conns), timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                stuck = sorted(conns.values())
                done = sorted(results)
                raise RanksTimeoutError(
                    f"rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} of {nproc} "
                    f"did not finish within {timeout:g} s"
                    + (f" (rank{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} did)" if done else "")
                    + ": is there a collective or a receive that some rank never joins?")
            for conn in ready:
                rank = conns.pop(conn)
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    code = procs[rank].join(5) or procs[rank].exitcode
                    raise RankError(f"rank {rank} died without a result (exit code {code})") from None
                if status == "error":
                    raise RankError(f"rank {rank} of {nproc} failed:\n{value}")
                results[rank] = value
    finally:
        _stop(procs)
        for conn in conns:
            conn.close()
    return [results[r] for r in range(nproc)]


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
            raise AssertionError(f"{what}: item {i} is {type(a).__name__}, expected a tensor")
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

    def counted(original):
        def send(tensor, *args, **kwargs):
            sent.bytes += tensor.numel() * tensor.element_size()
            sent.messages += 1
            return original(tensor, *args, **kwargs)
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
