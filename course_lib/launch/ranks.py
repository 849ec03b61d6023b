"""The one local rank runner: a function on N processes of this machine, started clean.

    from course_lib.launch.ranks import run_local
    values = run_local(fn, 2, args=(x,), pass_rank=True)        # fn(rank, world_size, x) on 2 gloo ranks
    value, = run_local(check, 1, backend=None, time_limit=10)   # one child, no process group

This is the engine, not a way for users: the course runs a function on N local ranks one way,
``run_ranks(fn, nproc, *args)`` (:mod:`course_lib.launch.spawn`; the exercises' grader has its
copy with the same signature, ``course_lib.exercises.grading``), with ``notebook_launcher``
(:mod:`course_lib.launch.forked`) as accelerate's name for the same, and ``RankPool``
(:mod:`course_lib.launch.rank_pool`) for ranks that live across cells. All are front-ends of
:func:`run_local`.

Not forked from the caller. A notebook kernel that initialised CUDA, ran a backward (autograd's
device threads) or started any thread cannot be forked safely: the child inherits a CUDA context
it cannot use ("CUDA error: initialization error") and locks held by threads that do not exist
in it; PyTorch refuses outright ("Unable to handle autograd's threading in combination with
fork-based multiprocessing"). The ranks are forked instead from a fork server (Python's
``forkserver`` start method, multiprocessing docs, "Contexts and start methods"): a fresh
interpreter, started once per kernel, that has imported torch and nothing of the kernel's
state, so that a rank starts in a fraction of a second rather than the seconds a fresh
interpreter takes to import torch (benchmarks/rank_start.py). Where the platform has no fork
server (Windows), ranks are spawned.

A rank therefore shares no memory with the caller: the function and its arguments are sent by
value with cloudpickle, so a function defined in a notebook cell, a closure or a lambda runs as
it is (functions of importable modules travel by name). What cannot be sent (a lock, an open
file, a generator) raises :class:`SendError` naming it, before any process starts. Values come
back by value (tensors too). Each rank gets the caller's environment as it is now, RANK,
WORLD_SIZE and LOCAL_RANK, ``threads`` torch threads, a parent-death signal, and prints lines
prefixed ``[rankN]``.

Python's rule for these start methods applies to scripts: a script that starts ranks does so
under the main-module guard (``if __name__ ...``), since each rank imports the caller's main module again (a
notebook or ``python -m pytest`` has nothing to re-run).

One rendezvous, one barrier: the ranks meet in a FileStore in a temporary directory (no port
that another process could take first), then pass one barrier before the function runs. Then
``timeout`` bounds every collective, ``time_limit`` the run (from the moment every rank is
ready), ``start_limit`` the start; :class:`RanksTimeoutError` names the ranks that did not
finish, :class:`RankError` carries the failing rank's traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import linecache
import multiprocessing as mp
import multiprocessing.util
import os
import pickle
import signal
import sys
import tempfile
import time
import types
from collections.abc import Callable, Mapping
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import cloudpickle

from course_lib.launch.procs import descendants, kill_quietly, signal_name, signal_quietly
from course_lib.launch.rank_child import by_value, code_key, code_objects, functions_sent, rank_main
from course_lib.utils import check_count, traceback_to_caller

LAST_WORDS_S = 1.0  # how long a run that has every result waits for its ranks' final output
START_LIMIT_S = 120.0  # the fork server's first start imports torch: seconds on a busy machine
# What the fork server imports once, so that no rank does: torch, its distributed package, the
# optimizers' lazy torch._dynamo (about 1 s), this runner and cloudpickle.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "cloudpickle", "course_lib.launch.rank_child"]
# Heavy optional packages the fork server imports too when the calling process already has: lesson
# 11's and exercise 07's ranks then find Lightning (and the transformers it brings) imported, instead
# of importing it in every rank of every run (about 4.5 s a rank on a laptop CPU).
PRELOAD_IF_IMPORTED = ("lightning", "transformers")


# The runner's errors: in a notebook, the traceback ends at the student's call (run_ranks(...)), not
# in the runner's frames (each marked __tracebackhide__); a RankError's message holds the rank's own.
class SendError(TypeError):
    """The function or an argument cannot be sent to the ranks (it cannot be pickled)."""

    _render_traceback_ = traceback_to_caller


class RankError(RuntimeError):
    """A rank raised or died: ``rank``, ``what`` ("KeyError: 'x'"), its ``traceback`` text,
    the ranks still ``waiting`` then and the seconds ``elapsed`` since the run started (since
    that rank was ready, by its own clock, when it raised)."""

    def __init__(self, message: str, rank: int, what: str, traceback_text: str = "",
                 waiting: list[int] | None = None, elapsed: float = 0.0):
        super().__init__(message)
        self.rank, self.what, self.traceback = rank, what, traceback_text
        self.waiting, self.elapsed = waiting or [], elapsed

    _render_traceback_ = traceback_to_caller


class RanksTimeoutError(TimeoutError):
    """Some ranks did not finish (``phase`` "run") or start ("start") in time; ``stuck`` lists them."""

    def __init__(self, message: str, stuck: list[int], phase: str = "run"):
        super().__init__(message)
        self.stuck, self.phase = stuck, phase

    _render_traceback_ = traceback_to_caller


def start_method() -> str:
    """"forkserver" where the platform has it (Linux, macOS), else "spawn"."""
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _context(method: str):
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Takes effect when this process starts its fork server (the first run); a server that
        # something else started already keeps its own list: ranks then import torch themselves.
        ctx.set_forkserver_preload(PRELOAD + [m for m in PRELOAD_IF_IMPORTED if m in sys.modules])
        _short_socket_folder()
        _stop_helpers_with_the_kernel()
    return ctx


# The fork server listens on $TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX (32 characters more than
# $TMPDIR); Linux's AF_UNIX path holds 107 (sun_path's 108 bytes, less the final NUL).
AF_UNIX_PATH_MAX, FORKSERVER_SOCKET_TAIL = 107, 32


def socket_needs_tmp(folder: str) -> bool:
    """Whether the fork server's socket under ``folder`` (a $TMPDIR) would be too long for an
    AF_UNIX path, and /tmp is there to take it instead."""
    return len(folder) + FORKSERVER_SOCKET_TAIL > AF_UNIX_PATH_MAX and os.access("/tmp", os.W_OK)


def _short_socket_folder() -> None:
    """Put multiprocessing's socket folder in /tmp when $TMPDIR is too long for a socket path.

    A cluster job's scratch folder often is (``/scratch/<user>/slurm-<job>/...``): on such a node the
    fork server would not start ("OSError: AF_UNIX path too long") and no rank would run. A
    Python whose multiprocessing has ``util._get_base_temp_dir`` falls back to /tmp by itself
    (none of 3.6 to 3.13.0 has it); for the others, multiprocessing's folder is made here, once, with ``tempfile.tempdir`` pointed at /tmp
    for that one call. multiprocessing removes the folder at exit, as it would its own.
    """
    util = multiprocessing.util
    if hasattr(util, "_get_base_temp_dir"):  # this Python chooses a short folder itself
        return
    if not socket_needs_tmp(tempfile.gettempdir()):
        return
    saved, tempfile.tempdir = tempfile.tempdir, "/tmp"
    try:
        util.get_temp_dir()  # made now under /tmp, and kept for this process (a folder made before stays)
    finally:
        tempfile.tempdir = saved


def _stop_helpers_with_the_kernel() -> None:
    """In a Jupyter kernel, stop the fork server and multiprocessing's resource tracker as soon as
    the kernel is asked to shut down (or restart).

    At shutdown ipykernel terminates every child in its process group and waits until they are gone
    (SIGTERM, retried for 14 s before SIGKILL); the resource tracker that the fork server brings
    ignores SIGTERM by design and lives while this process holds its pipe. So a kernel that had run
    ranks never finished its own shutdown: the frontend killed it after its wait (jupyter_client:
    2.5 s, then SIGTERM), skipping its atexit handlers. ``do_shutdown`` sets the shell's
    ``exit_now`` before that wait: observing it, the helpers are stopped first, and the kernel
    shuts down as one that ran no ranks.
    """
    ipython = sys.modules.get("IPython")  # a kernel has imported it; a script has not
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None and getattr(shell, "kernel", None) is not None:
        shell.observe(_stop_helpers, names="exit_now")  # once: traitlets keeps one of each handler


def _stop_helpers(change) -> None:
    if not change["new"]:
        return
    # The fork server first: it holds the resource tracker's pipe too. SIGTERM ends it at once (left
    # to exit by itself it tears down its imported torch, about 1 s; its ranks, if any, follow it by
    # their parent-death signal). ``_stop`` (Python >= 3.8) closes this process's end of a helper's
    # pipe and reaps it; attributes a Python lacks are skipped. The fork server's ``_stop`` also
    # unlinks its socket, which may be gone already (its temporary folder removed): that must not
    # keep the tracker running, which would bring back the slow shutdown.
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    if getattr(server, "_forkserver_pid", None):
        signal_quietly(server._forkserver_pid, signal.SIGTERM)
    tracker = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
    for helper in (server, tracker):
        stop = getattr(helper, "_stop", None)
        if stop is not None:
            with contextlib.suppress(OSError):  # its socket or pipe already gone: stopped, as far as we can tell
                stop()


def _culprit(name: str, obj: Any, dumps, seen: frozenset = frozenset()) -> str:
    """Which part of ``obj`` cannot be pickled: a closure variable or global of a function
    (``seen``: the functions on the way down, for functions that call each other)."""
    code = getattr(obj, "__code__", None)
    if code is not None and id(obj) not in seen:
        seen = seen | {id(obj)}
        cells = dict(zip(code.co_freevars, obj.__closure__ or ()))
        # (an empty cell, a name not bound yet, equals a new one and holds nothing to send)
        parts = [(f"variable {k!r} of {name}", c.cell_contents) for k, c in cells.items()
                 if c != types.CellType()]
        parts += [(f"global {k!r} used by {name}", obj.__globals__[k]) for k in code.co_names
                  if k in obj.__globals__]
        for what, value in parts:
            if id(value) in seen:
                continue
            try:
                dumps(value)
            except Exception:  # noqa: BLE001 - looking for the first that fails
                return _culprit(what, value, dumps, seen)
    return f"{name} (a {type(obj).__name__})"


def _dumps(obj: Any) -> bytes:
    """cloudpickle, except that a module loaded from a file travels by name: a test's fresh copy
    of ``course_lib.exercises.grading`` (not in ``sys.modules``) is imported again in the rank,
    not sent with everything it holds."""
    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            spec = getattr(obj, "__spec__", None) if isinstance(obj, types.ModuleType) else None
            if spec is not None and spec.origin and obj.__name__ != "__main__":
                return importlib.import_module, (obj.__name__,)
            return super().reducer_override(obj)

    buf = io.BytesIO()
    Pickler(buf, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


def cell_code(fn: Callable, args: tuple, kwargs: dict) -> dict:
    """The names of the notebook cells (or the script) that the code sent to the ranks by value
    comes from, and the cells' lines, for :func:`course_lib.launch.rank_child.name_cells`:
    {"names": {code_key: "Cell In[3]"}, "lines": {"Cell In[3]": [...]}}. A cell is named as
    IPython's tracebacks name it (``format_code_name``, since IPython 8.0); the script that runs as
    ``__main__`` by its path, which the ranks read themselves. Code sent by value from another
    file (a grader's test, which otter compiles from its file: ``q1_dispatch.py``) by the file's
    name, with no lines: a hidden test's lines must not reach a student's report. Other code keeps
    cloudpickle's name."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    cell_name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    script = getattr(sys.modules.get("__main__"), "__file__", None)

    def name_of(f) -> tuple[str, str] | None:
        """(name, "script" | "cell" | "file"), or None for code that keeps cloudpickle's name."""
        path = f.__code__.co_filename
        if path == script:
            return script, "script"
        cell = cell_name(path) if cell_name is not None else None
        if cell:
            return " ".join(cell), "cell"  # ("Cell", "In[3]")
        return (os.path.basename(path), "file") if by_value(f) and os.path.isfile(path) else None

    names, lines = {}, {}
    try:
        for f in functions_sent([fn, *args, *kwargs.values()], lambda f: name_of(f) is not None):
            name, kind = name_of(f)
            if kind == "cell":
                lines.setdefault(name, linecache.getlines(f.__code__.co_filename))
            elif kind == "file":  # a test's lines never travel (the script's the ranks read themselves)
                lines.setdefault(name, [])
            names.update((code_key(code), name) for code in code_objects(f.__code__))
    except Exception:  # noqa: BLE001 - names only help to read a traceback: never a reason not to run
        return {"names": {}, "lines": {}}
    return {"names": names, "lines": lines}


def pack(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """``(fn, args, kwargs)`` as bytes for the ranks, or :class:`SendError` saying what cannot go."""
    __tracebackhide__ = True  # the runner's own frame (see SendError)
    try:
        return _dumps((fn, tuple(args), dict(kwargs)))
    except Exception as e:  # noqa: BLE001 - find the part that failed, for the message
        parts = [("the function", fn), *((f"argument {i}", a) for i, a in enumerate(args)),
                 *((f"keyword argument {k!r}", v) for k, v in kwargs.items())]
        where = "something sent to the ranks"
        for name, value in parts:
            try:
                _dumps(value)
            except Exception:  # noqa: BLE001
                where = _culprit(name, value, _dumps)
                break
        raise SendError(f"cannot send {where} to the ranks: {type(e).__name__}: {e}. The ranks are "
                        "separate processes and get a copy of the function and its arguments; "
                        "create this object inside the function instead.") from None


class _Run:
    """The parent's side: messages, deaths and clocks of the started ranks."""

    def __init__(self, procs: list, conns: list, limits: tuple):
        self.procs, self.conns = procs, dict(enumerate(conns))
        self.start_limit, self.time_limit = limits
        self.started, self.run_start = time.monotonic(), None
        self.ready: set[int] = set()
        self.results: dict[int, Any] = {}

    def elapsed(self) -> float:
        return 0.0 if self.run_start is None else time.monotonic() - self.run_start

    def waiting(self, but: int | None = None) -> list[int]:
        return [r for r in range(len(self.procs)) if r not in self.results and r != but]

    def handle(self, rank: int) -> None:
        __tracebackhide__ = True  # the runner's own frame: a notebook's traceback ends at the caller
        try:
            msg = pickle.loads(self.conns[rank].recv_bytes())
        except (EOFError, OSError):  # closed: the rank exited (its exit code says how)
            del self.conns[rank]
            return
        if msg[0] == "out":
            stream = sys.stdout if msg[1] == 1 else sys.stderr
            stream.write(msg[2])
            stream.flush()
        elif msg[0] == "ready":
            self.ready.add(rank)
            if len(self.ready) == len(self.procs):
                self.run_start = time.monotonic()
        elif msg[0] == "ok":
            try:
                self.results[rank] = pickle.loads(msg[2])
            except Exception as e:  # noqa: BLE001 - anything its class's unpickling raises: name the rank
                what = f"its result was sent but cannot be rebuilt here ({type(e).__name__}: {e})"
                raise RankError(f"rank {rank} failed: {what}; return plain values (numbers, lists, dicts, "
                                "tensors)", rank, what, "", self.waiting(but=rank), self.elapsed()) from None
        else:
            _, rank, what, text, elapsed = msg  # the rank's own clock: the parent hears late
            raise RankError(f"rank {rank} failed: {what}\n{text}", rank, what, text,
                            self.waiting(but=rank), elapsed)

    def check_clocks(self) -> None:
        __tracebackhide__ = True  # the runner's own frame: a notebook's traceback ends at the caller
        now = time.monotonic()
        if self.run_start is None and now - self.started > self.start_limit:
            stuck = [r for r in range(len(self.procs)) if r not in self.ready]
            raise RanksTimeoutError(f"the ranks did not start within {self.start_limit:g} s; "
                                    f"not ready: rank {', '.join(map(str, stuck))}", stuck, "start")
        if self.run_start is not None and self.time_limit is not None and now - self.run_start > self.time_limit:
            stuck = self.waiting()
            raise RanksTimeoutError(f"time limit of {self.time_limit:g} s reached; ranks {stuck} "
                                    "did not finish", stuck)

    def check_deaths(self) -> None:
        __tracebackhide__ = True  # the runner's own frame: a notebook's traceback ends at the caller
        for rank, p in enumerate(self.procs):
            if p.exitcode is None or rank in self.results:
                continue
            while rank in self.conns and self.conns[rank].poll():  # its last words first
                self.handle(rank)
            if rank not in self.results:
                sig = signal_name(p.exitcode)
                how = f"was killed by {sig}" if sig else f"exited with code {p.exitcode}"
                what = f"the process {how} without reporting a result"
                raise RankError(f"rank {rank} failed: {what}", rank, what, "",
                                self.waiting(but=rank), self.elapsed())

    def loop(self) -> list:
        __tracebackhide__ = True  # the runner's own frame: a notebook's traceback ends at the caller
        n = len(self.procs)
        while len(self.results) < n:
            self.check_clocks()
            # an exited rank's sentinel stays ready: only the live ones, or this loop would spin
            live = [p.sentinel for p in self.procs if p.exitcode is None]
            for ready in wait([*self.conns.values(), *live], timeout=0.1):
                for rank, conn in list(self.conns.items()):
                    if conn is ready:
                        self.handle(rank)
            self.check_deaths()
        self.last_words()
        return [self.results[r] for r in range(n)]

    def last_words(self) -> None:
        """Read what the ranks print after their result until they exit (a few ms; at most
        LAST_WORDS_S): a rank sends its value first and flushes its streams after, so its last
        line printed without a newline (``print(..., end="")``, a progress line) came after the
        result and was dropped when the run stopped at the last result."""
        deadline = time.monotonic() + LAST_WORDS_S
        while self.conns:
            exited = all(p.exitcode is not None for p in self.procs)  # before reading: then all is there
            for rank in list(self.conns):
                while rank in self.conns and self.conns[rank].poll():
                    self.handle(rank)
            left = deadline - time.monotonic()
            if exited or left <= 0:
                return
            live = [p.sentinel for p in self.procs if p.exitcode is None]
            wait([*self.conns.values(), *live], timeout=left)

    def stop(self) -> None:
        _kill_ranks(self.procs)
        for p in self.procs:
            p.join(5.0)
        for conn in self.conns.values():
            conn.close()


def _kill_ranks(procs: list) -> None:
    """SIGKILL the ranks still running and the processes they started themselves (DataLoader
    workers, a subprocess): a rank killed alone leaves those running, with nobody to stop them."""
    alive = [p for p in procs if p.exitcode is None and p.pid is not None]
    children = [c for p in alive for c in descendants(p.pid)]  # before the kill: then init owns them
    for p in alive:
        p.kill()
    kill_quietly(children)


def check_call(fn, args, kwargs, pass_rank: bool, threads, method) -> None:
    """What every front-end would otherwise learn from a failing rank: ``fn`` is a function that
    takes the arguments it will get, ``args`` a tuple, ``kwargs`` a dict, ``threads`` a count and
    ``method`` a start method of this platform."""
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {fn!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of arguments, such as (x,) for one, got {args!r}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a dict of keyword arguments, got {kwargs!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: the rank will say
        signature = None
    if signature is not None:
        given = ((0, 1) if pass_rank else ()) + tuple(args)
        try:
            signature.bind(*given, **(kwargs or {}))
        except TypeError as e:
            how = "fn(rank, world_size, *args)" if pass_rank else "fn(*args, **kwargs)"
            raise TypeError(f"each rank calls {how}, which {getattr(fn, '__name__', 'fn')}{signature} "
                            f"cannot take: {e}") from None
    check_count("threads", threads)
    if method is not None and method not in mp.get_all_start_methods():
        raise ValueError(f"start method must be one of {mp.get_all_start_methods()}, got {method!r}")


def run_local(fn: Callable[..., Any], nproc: int, args: tuple = (), kwargs: dict | None = None, *,
              backend: str | None = "gloo", pass_rank: bool = False, timeout: float | None = None,
              time_limit: float | None = None, start_limit: float = START_LIMIT_S, threads: int = 1,
              prefix: str | None = "[rank{rank}] ", method: str | None = None) -> list:
    """Run ``fn(*args, **kwargs)`` (``pass_rank``: ``fn(rank, world_size, *args, **kwargs)``) on
    ``nproc`` processes; return their values by rank.

    backend: "gloo", "nccl" (one GPU per rank) or None (no process group). timeout: seconds of
    every collective (torch's default without). time_limit: seconds of the run, from the moment
    every rank is ready; start_limit: seconds until then. prefix: put before each line a rank
    prints ("{rank}" filled in), which comes back to this process's ``sys.stdout`` or
    ``sys.stderr`` (a notebook cell's output); None: the ranks print to the file descriptors
    they inherit. method: the start method (default :func:`start_method`; "fork" only to
    compare). The caller checks its own arguments (nproc, backend, timeouts); the call itself is
    checked here, before anything starts (:func:`check_call`), and :class:`SendError` raised for
    what cannot be sent.
    """
    __tracebackhide__ = True  # the runner's own frame: a notebook's traceback ends at the caller
    check_call(fn, args, kwargs, pass_rank, threads, method)
    payload = pack(fn, args, kwargs or {})
    method = method or start_method()
    ctx = _context(method)
    with tempfile.TemporaryDirectory(prefix="course_ranks_") as tmp:
        settings = {"world_size": nproc, "backend": backend, "store": f"file://{Path(tmp) / 'store'}",
                    "timeout": timeout, "threads": threads, "env": dict(os.environ),
                    "prefix": prefix, "pass_rank": pass_rank, "method": method,
                    "cells": cell_code(fn, args, kwargs or {})}

        procs, conns = [], []
        try:
            for rank in range(nproc):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(target=rank_main, args=(payload, rank, settings, send),
                                name=f"rank{rank}")
                procs.append(p)
                conns.append(recv)
                p.start()
                send.close()
            run = _Run(procs, conns, (start_limit, time_limit))
            try:
                return run.loop()
            finally:
                run.stop()
        finally:
            _kill_ranks(procs)
            for p in procs:
                if p.pid is not None:
                    p.join(5.0)
