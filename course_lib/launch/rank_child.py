"""What one local rank runs (:mod:`course_lib.launch.ranks` starts it): set up, join the group,
call the function, send back its value or its traceback.

Every message to the parent goes through one pipe, as plain pickles of small tuples:

    ("out", stream, text)            lines the rank printed (stream 1: stdout, 2: stderr)
    ("ready", rank)                  set up (and, with a group, past the barrier): the run starts
    ("ok", rank, data)               the function's value, cloudpickled (tensors by value)
    ("error", rank, what, text, s)   "KeyError: 'x'", the traceback, seconds since "ready"
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback

import cloudpickle

from course_lib.launch.procs import reset_locks_after_fork, set_parent_death_signal
from course_lib.utils import init_process_group


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
    timeout, threads, env, prefix, pass_rank, method."""
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
        tb = e.__traceback__.tb_next if e.__traceback__ else None  # not this frame
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
