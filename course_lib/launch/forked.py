"""notebook_launcher(fn, args, nproc=2): run a function defined in the notebook on N processes.

    def step(scale):
        t = torch.full((2,), float(dist.get_rank() + 1)) * scale
        dist.all_reduce(t)
        return t
    results = notebook_launcher(step, (10.0,), nproc=2)   # [tensor([30., 30.]), tensor([30., 30.])]

For short CPU exercises: the processes are forked from the kernel, so the function needs no
file and sees the notebook's imports and globals (the idea of accelerate's notebook_launcher).
Each child gets RANK, WORLD_SIZE, LOCAL_RANK, the default process group (gloo, with a
collective timeout) and its share of the CPU threads; rank k's return value is ``results[k]``.
A failure in any rank stops the others and raises :class:`NotebookLaunchError` naming the rank,
with its traceback. The ranks are CPU processes, so they may be forked even after the kernel
initialised CUDA (on Colab's one GPU, say), as PyTorch's DataLoader forks its workers; only a
function that itself uses CUDA fails there (PyTorch: "Cannot re-initialize CUDA in forked
subprocess"), and the error then says to use a ``%%torchrun`` cell instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

from course_lib.hardware import threads_per_rank
from course_lib.launch.agent import loopback_store_class
from course_lib.launch.bootstrap import diagnose
from course_lib.launch.checks import LaunchConfigError
from course_lib.launch.procs import reset_locks_after_fork, set_parent_death_signal
from course_lib.utils import free_port


class NotebookLaunchError(RuntimeError):
    def __init__(self, message: str, rank: int | None = None, traceback_text: str | None = None):
        super().__init__(message)
        self.rank, self.traceback = rank, traceback_text


CUDA_IN_FORK_HINT = ("this function uses CUDA, which a forked process cannot; notebook_launcher's ranks are "
                     "CPU processes. Put the code in a %%torchrun cell (separate processes, one GPU each).")


class _RankWriter:
    """A text stream for a child: each line goes to the inherited fd, prefixed with the rank."""

    def __init__(self, fd: int, rank: int):
        self.fd, self.prefix, self.buf = fd, f"[rank{rank}] ", ""

    def write(self, s: str) -> int:
        self.buf += s
        *lines, self.buf = self.buf.split("\n")
        if lines:
            os.write(self.fd, "".join(f"{self.prefix}{line}\n" for line in lines).encode())
        return len(s)

    def flush(self) -> None:
        if self.buf:
            os.write(self.fd, f"{self.prefix}{self.buf}\n".encode())
            self.buf = ""

    def isatty(self) -> bool:
        return False


def _child(fn, args, kwargs, rank, nproc, port, backend, timeout_s, threads, conn) -> None:
    set_parent_death_signal(signal.SIGKILL)  # the kernel died: nothing to report to
    reset_locks_after_fork()  # a lock another thread of the kernel held at fork stays held here
    code = 0
    try:
        sys.stdout, sys.stderr = _RankWriter(1, rank), _RankWriter(2, rank)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch  # in the forked child: `from course_lib.launch import ...` stays torch-free
        import torch.distributed as dist

        torch.set_num_threads(threads)
        timeout = timedelta(seconds=timeout_s)
        store_cls = loopback_store_class()[1] if rank == 0 else dist.TCPStore
        store = store_cls("127.0.0.1", port, nproc, rank == 0, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=nproc, timeout=timeout)
        result = fn(*args, **kwargs)
        # Plain pickle: tensors travel by value (the multiprocessing pickler would share their
        # memory through a file descriptor that dies with this process).
        conn.send_bytes(pickle.dumps(("ok", rank, result)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        code = 1
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None))
        _, hint = diagnose(f"{type(e).__name__}: {e}", "run", timeout_s)
        if "re-initialize CUDA in forked subprocess" in str(e):
            hint = CUDA_IN_FORK_HINT
        try:
            conn.send_bytes(pickle.dumps(("error", rank, f"{type(e).__name__}: {e}", text, hint)))
        except Exception:  # noqa: BLE001, S110 - e.g. unpicklable: the parent sees exit code 1
            pass
    finally:
        for s in (sys.stdout, sys.stderr):
            s.flush()
        # Never run the kernel's atexit handlers or flush its buffers from a forked child.
        os._exit(code)


def notebook_launcher(fn, args: tuple = (), nproc: int = 2, *, kwargs: dict | None = None,
                      backend: str = "gloo", timeout: float = 60.0, time_limit: float | None = None,
                      threads: int | None = None) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nproc`` forked processes; return their results by rank.

    timeout: collective timeout of the process group, seconds. time_limit: wall clock for the
    whole call (None: none). threads: torch threads per process (default: cores // nproc).
    """
    if not callable(fn):
        raise LaunchConfigError(f"fn must be a function, got {type(fn).__name__}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise LaunchConfigError(f"nproc must be a whole number >= 1, got {nproc!r}")
    if backend != "gloo":
        raise LaunchConfigError(f"notebook_launcher runs on CPU with backend='gloo' (got {backend!r}); "
                                "use %%torchrun or launch() for NCCL on GPUs")
    if timeout <= 0 or (time_limit is not None and time_limit <= 0):
        raise LaunchConfigError("timeout and time_limit must be > 0 seconds")
    if "fork" not in mp.get_all_start_methods():
        raise LaunchConfigError("this platform cannot fork; use %%torchrun or launch() instead")
    ctx = mp.get_context("fork")
    port, threads = free_port(), threads or threads_per_rank(nproc)
    procs, conns = [], {}
    for rank in range(nproc):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(fn, args, kwargs or {}, rank, nproc, port, backend,
                                              timeout, threads, send), daemon=True)
        p.start()
        send.close()
        procs.append(p)
        conns[recv] = rank
    results: dict[int, object] = {}
    start = time.monotonic()
    try:
        while len(results) < nproc:
            if time_limit is not None and time.monotonic() - start > time_limit:
                raise NotebookLaunchError(f"time limit of {time_limit:g} s reached; ranks "
                                          f"{sorted(set(range(nproc)) - set(results))} did not finish")
            ready = wait(list(conns) + [p.sentinel for p in procs if p.exitcode is None], timeout=0.1)
            for r in ready:
                if r in conns:
                    try:
                        msg = pickle.loads(r.recv_bytes())
                    except EOFError:  # the child died without a word: its exit code says how
                        del conns[r]
                        continue
                    if msg[0] == "error":
                        _, rank, what, text, hint = msg
                        sys.stderr.write(text)
                        waiting = sorted(set(range(nproc)) - set(results) - {rank})
                        more = f"\nranks still running (did not join?): {waiting}" if hint and waiting else ""
                        raise NotebookLaunchError(f"rank {rank} failed: {what}" + (f"\n{hint}" if hint else "")
                                                  + more, rank, text)
                    results[msg[1]] = msg[2]
            for rank, p in enumerate(procs):
                if p.exitcode not in (None, 0) and rank not in results and not any(
                        c.poll() for c, k in conns.items() if k == rank):
                    sig = -p.exitcode if p.exitcode < 0 else None
                    how = f"was killed by {signal.Signals(sig).name}" if sig else f"exited with code {p.exitcode}"
                    raise NotebookLaunchError(f"rank {rank} {how} without reporting a result", rank)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join()
    return [results[r] for r in range(nproc)]
