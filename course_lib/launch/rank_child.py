"""What one local rank runs (:mod:`course_lib.launch.ranks` starts it): set up, join the group,
call the function, send back its value or its traceback.

Every message to the parent goes through one pipe, as plain pickles of small tuples:

    ("out", stream, text)            lines the rank printed (stream 1: stdout, 2: stderr)
    ("ready", rank)                  set up (and, with a group, past the barrier): the run starts
    ("ok", rank, data)               the function's value, cloudpickled (tensors by value)
    ("error", rank, what, text, s)   "KeyError: 'x'", the traceback, seconds since "ready"

A function of a notebook cell (or of the script run as ``__main__``) travels by value. Recent
cloudpickle names the file of every code object it sends that way ``<dynamic-code>``
(cloudpipe/cloudpickle#560, 2025), and older versions keep a cell's temporary file name, which
a rank cannot read: either way a rank's traceback said ``File "<dynamic-code>", line 7, in
show`` and showed no line. The parent therefore sends, beside the function, the names and lines of the cells it
came from (:func:`course_lib.launch.ranks.cell_code`); the rank gives its copies of those code
objects their cell's name back (:func:`name_cells`), so that its traceback reads ``File "Cell
In[3]", line 7, in show`` with the line, as the notebook's own would. Code that a grader compiled
from a test file and sent by value gets the file's name back, without its lines.
"""

from __future__ import annotations

import functools
import linecache
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator

import cloudpickle

from course_lib.launch.procs import reset_locks_after_fork, set_parent_death_signal
from course_lib.utils import init_process_group, without_hidden_tail


class _Sender:
    """The pipe to the parent; a lock, because a rank's own threads may print while it reports."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message)
        with self.lock:
            self.conn.send_bytes(data)


class _Lines:
    """A text stream that sends whole lines to the parent, each prefixed (``[rank1] ``)."""

    def __init__(self, sender: _Sender, stream: int, prefix: str):
        self.sender, self.stream, self.prefix, self.buf = sender, stream, prefix, ""

    def write(self, s: str) -> int:
        self.buf += s
        *lines, self.buf = self.buf.split("\n")
        if lines:
            self.sender.send(("out", self.stream, "".join(f"{self.prefix}{line}\n" for line in lines)))
        return len(s)

    def flush(self) -> None:
        if self.buf:
            self.sender.send(("out", self.stream, f"{self.prefix}{self.buf}\n"))
            self.buf = ""

    def isatty(self) -> bool:
        return False

    # What code that wants a real stream asks of sys.stdout/sys.stderr (faulthandler.enable(), a
    # subprocess given stdout=sys.stdout): the process's own file descriptor 1 or 2, as Jupyter's
    # streams answer; what goes there bypasses the prefixes and reaches the parent's own stream.
    encoding, errors = "utf-8", "strict"

    def fileno(self) -> int:
        return self.stream


def by_value(fn: types.FunctionType) -> bool:
    """Whether cloudpickle sends ``fn`` by value because it cannot import it by name: a function
    of ``__main__`` (a notebook cell, a script), of no module or of one the process has not
    imported (code a grader compiled and ran), or one defined inside another function."""
    module = getattr(fn, "__module__", None)
    return module is None or module == "__main__" or module not in sys.modules or "<locals>" in fn.__qualname__


def functions_sent(roots, of_interest: Callable[[types.FunctionType], bool]) -> Iterator[types.FunctionType]:
    """The functions reachable from ``roots`` that are ``of_interest``: the roots themselves
    (functions, partials, methods, classes), then the globals, closures and defaults those
    functions use, and the methods of classes among them. A function that is not of interest is
    followed only when it travels by value too (:func:`by_value`): a grader's test function that
    calls the student's function of a cell leads to that function, while a library's functions
    travel by reference, with their files, and are not followed."""
    seen, stack = set(), list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            stack += [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, (staticmethod, classmethod, types.MethodType)):
            stack.append(obj.__func__)
        elif isinstance(obj, property):
            stack += [obj.fget, obj.fset, obj.fdel]
        elif isinstance(obj, type):
            stack += list(vars(obj).values())
        elif isinstance(obj, types.FunctionType) and ((wanted := of_interest(obj)) or by_value(obj)):
            if wanted:
                yield obj
            names = {n for code in code_objects(obj.__code__) for n in code.co_names}
            stack += [obj.__globals__[n] for n in names if n in obj.__globals__]
            stack += [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            stack += [*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code nested in it (inner functions, lambdas, comprehensions, classes)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from code_objects(const)


def code_key(code: types.CodeType) -> tuple:
    """What identifies a code object on both sides of the pipe (its file name does not travel)."""
    return code.co_name, code.co_firstlineno, code.co_code


def name_cells(roots, cells: dict) -> None:
    """Give the code sent by value from notebook cells (or a script, or a grader's test file) its
    name back, and the cells' lines to ``linecache`` (``cells``: {"names": {code_key: name},
    "lines": {name: [...]}}; a test file's lines are [], so that none is shown)."""
    names = cells["names"]
    if not names:
        return
    for name, lines in cells["lines"].items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)  # mtime None: never checked on disk

    def renamed(code: types.CodeType) -> types.CodeType:
        consts = tuple(renamed(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
        return code.replace(co_filename=names.get(code_key(code), code.co_filename), co_consts=consts)

    try:
        for fn in list(functions_sent(roots, lambda f: code_key(f.__code__) in names)):
            fn.__code__ = renamed(fn.__code__)
    except Exception:  # noqa: BLE001, S110 - names only help to read a traceback: the function runs anyway
        pass


def _join_group(rank: int, s: dict) -> None:
    # torch in the rank only: the parent imports this module (launch.ranks) without it
    import torch
    import torch.distributed as dist

    device = None
    if s["backend"] == "nccl":  # one GPU per rank (the parent checked there are enough)
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    init_process_group(s["backend"], timeout_s=s["timeout"], device=device, init_method=s["store"],
                       rank=rank, world_size=s["world_size"])
    # gloo's init returns on a rank once its own connections are up; a rank whose function is
    # quick could then exit while a peer still completes its handshake with it ("connectFullMesh
    # failed: Connection closed by peer"): everyone is connected before the function runs.
    dist.barrier()


def rank_main(payload: bytes, rank: int, s: dict, conn) -> None:
    """The target of each rank's process. ``s``: world_size, backend (None: no group), store,
    timeout, threads, env, prefix, pass_rank, method, cells (:func:`name_cells`)."""
    set_parent_death_signal(signal.SIGKILL)  # the parent (or the fork server) died: nobody to report to
    if s["method"] == "fork":  # only a fork copies the locks that the parent's threads held
        reset_locks_after_fork()
    # The fork server was started earlier: take the parent's environment as it is now.
    os.environ.clear()
    os.environ.update(s["env"], RANK=str(rank), WORLD_SIZE=str(s["world_size"]), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(s["world_size"]), OMP_NUM_THREADS=str(s["threads"]))
    sender, code = _Sender(conn), 0
    if s["prefix"] is not None:
        sys.stdout = _Lines(sender, 1, s["prefix"].format(rank=rank))
        sys.stderr = _Lines(sender, 2, s["prefix"].format(rank=rank))
    joined, ready_at = False, None
    try:
        # torch in the rank only: the parent imports this module (launch.ranks) without it
        import torch

        torch.set_num_threads(s["threads"])
        fn, args, kwargs = pickle.loads(payload)  # cloudpickle's output is read by plain pickle
        name_cells([fn, *args, *kwargs.values()], s["cells"])
        if s["backend"] is not None:
            _join_group(rank, s)
            joined = True
        sender.send(("ready", rank))
        ready_at = time.monotonic()  # a collective's timeout counts from here, not from the parent's view
        result = fn(rank, s["world_size"], *args, **kwargs) if s["pass_rank"] else fn(*args, **kwargs)
        try:
            data = cloudpickle.dumps(result)
        except Exception as e:  # noqa: BLE001 - a value that cannot travel: say so, as an error
            raise TypeError(f"rank {rank}'s function returned a {type(result).__name__}, which cannot "
                            f"be sent back to the parent ({type(e).__name__}: {e})") from None
        sender.send(("ok", rank, data))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        code, joined = 1, False  # after an error, leave without a goodbye to the peers
        # not this frame, nor the course's checks that raised (__tracebackhide__, as in the notebook)
        tb = without_hidden_tail(e.__traceback__.tb_next) if e.__traceback__ else None
        text = "".join(traceback.format_exception(type(e), e, tb))
        try:
            elapsed = 0.0 if ready_at is None else time.monotonic() - ready_at
            sender.send(("error", rank, f"{type(e).__name__}: {e}", text, elapsed))
        except Exception:  # noqa: BLE001, S110 - the parent then sees the exit code
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if joined:
            # torch in the rank only: the parent imports this module (launch.ranks) without it
            import torch.distributed as dist

            if dist.is_initialized():  # the function may have ended the group itself (the trainer does)
                dist.destroy_process_group()
        # Neither the parent's exit handlers (fork) nor multiprocessing's clean-up: just leave.
        os._exit(code)
