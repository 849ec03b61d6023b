"""python -m course_lib.launch.rank_pool_engine engine|controller [ipyparallel args]   (RankPool runs it)

What runs inside the processes of a :class:`course_lib.launch.rank_pool.RankPool`:

* the entry point of each ipyparallel engine and of its controller. It watches the process that
  started it (the notebook kernel) and exits when that process is gone, so a kernel that is
  killed or restarted leaves no rank behind (and, the controller sees to it, no pool folder);
  then it runs ipyparallel's own entry point;
* :func:`setup`, called on each engine once: the rank's device and threads, the default process
  group (meeting in a FileStore), and the names a cell sees (``torch``, ``dist``, ``RANK``,
  ``WORLD_SIZE``, ``DEVICE``);
* the collective tracker: every blocking collective of ``torch.distributed`` called by name
  (``dist.all_reduce(...)``, also from course_lib) writes what it is waiting in to a file of its
  rank while it runs, so that when a cell hangs the pool can say which ranks waited in which
  collective, though they are stuck inside C++ and cannot answer;
* :func:`regroup`: a new process group after a hang (a timed-out gloo group is not reused);
* the ``engine`` role is a small parent that runs the engine as its child, forwards signals to it
  and writes its exit status to ``$COURSE_RANKS_DIR/exit.PID``, so the pool can say how a rank
  died (ipyparallel only sees that it is gone); teaching mode
  (:mod:`course_lib.parallel.collective_check`) is installed by :func:`setup` and :func:`regroup`.
"""

from __future__ import annotations

import functools
import os
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

from course_lib.launch.procs import descendants, kill_quietly
from course_lib.utils import init_process_group

# The blocking collectives and point-to-point calls of torch.distributed, tracked by name.
TRACKED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
           "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
           "monitored_barrier", "send", "recv", "scatter", "gather", "broadcast_object_list",
           "gather_object", "scatter_object_list")


def _track(fn, name: str, op_file: str):
    @functools.wraps(fn)
    def tracked(*args, **kwargs):
        __tracebackhide__ = True  # IPython leaves this frame out of the rank's traceback
        if kwargs.get("async_op"):  # returns at once; the wait is the caller's
            return fn(*args, **kwargs)
        peer = kwargs.get("src", kwargs.get("dst"))
        peer = args[1] if peer is None and name in ("send", "recv", "broadcast", "reduce") and len(args) > 1 \
            else peer
        with open(op_file, "w") as f:
            f.write(f"{name}\t{time.time():.3f}\t{'' if peer is None else peer}\n")
        try:
            return fn(*args, **kwargs)
        finally:
            try:
                os.remove(op_file)
            except FileNotFoundError:
                pass
    tracked.__course_tracked__ = fn
    return tracked


def install_tracker(op_file: str) -> None:
    """Wrap each of :data:`TRACKED` in ``torch.distributed`` (once per process)."""
    # torch on the engine only: the notebook's kernel imports this module to send it
    import torch.distributed as dist

    for name in TRACKED:
        fn = getattr(dist, name, None)
        if fn is not None and not hasattr(fn, "__course_tracked__"):
            setattr(dist, name, _track(fn, name, op_file))


def _init_group(backend: str, store: str, rank: int, world_size: int, timeout_s: float, device: str) -> None:
    # torch on the engine only: the notebook's kernel imports this module to send it
    from torch.distributed import distributed_c10d as c10d

    # NCCL: the communicator is bound to this rank's GPU
    init_process_group(backend, timeout_s=timeout_s, device=device, init_method=f"file://{store}",
                       rank=rank, world_size=world_size)
    c10d.barrier()  # everyone connected before the first cell runs (c10d's own: not tracked nor recorded)


def setup(rank: int, world_size: int, backend: str, device: str, store: str, op_file: str,
          timeout_s: float, threads: int, check: bool = True, generation: int = 0) -> int:
    """Make this engine rank ``rank``; returns its pid (the pool signals ranks by pid)."""
    # torch on the engine only: the notebook's kernel imports this module to send it
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    _init_group(backend, store, rank, world_size, timeout_s, device)
    _install_check(check, timeout_s, generation)  # inside the tracker: a wait in the exchange is named as the call
    install_tracker(op_file)
    _stderr_to_log()
    user = _user_namespace()
    user.update(torch=torch, dist=dist, RANK=rank, WORLD_SIZE=world_size, DEVICE=torch.device(device))
    user["_course_preset"] = frozenset(user)  # what a student did not define (rank_pool._user_names)
    return os.getpid()


def _stderr_to_log() -> None:
    """C++ writes to file descriptor 2 (gloo's abort: "terminate called after throwing ...") go
    straight to the engine's log file again, not through ipykernel's pipe: its reader thread dies
    with the process before forwarding the last words, which the pool shows when a rank dies."""
    original = getattr(sys.stderr, "_original_stdstream_copy", None)
    if original is not None:
        os.dup2(original, 2)


def regroup(backend: str, store: str, rank: int, world_size: int, timeout_s: float, device: str,
            check: bool = True, generation: int = 0) -> bool:
    """Replace the default process group by a new one meeting in ``store``."""
    # torch on the engine only: the notebook's kernel imports this module to send it
    import torch.distributed as dist

    if dist.is_initialized():
        _forget_side_group()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - a group broken by a timeout may fail to close
            pass
    _init_group(backend, store, rank, world_size, timeout_s, device)
    _install_check(check, timeout_s, generation)  # a new side group for the new default group
    return True


def _install_check(check: bool, timeout_s: float, generation: int) -> None:
    from course_lib.parallel.collective_check import install_collective_check as install  # torch: ranks only

    install(check, timeout_s, generation)


def _forget_side_group() -> None:
    from course_lib.parallel.collective_check import forget_side_group as forget  # torch: ranks only

    forget()


def set_check(check: bool) -> bool:
    from course_lib.parallel.collective_check import set_collective_check  # torch: ranks only

    return set_collective_check(check)


def before_cell(prompt: int | None, timeout_s: float) -> None:
    """Run on each rank just before a cell. ``prompt``: number the cell as the notebook's, so that
    its tracebacks say "Cell In[7]" for the notebook's In [7] (an engine counts only the cells it
    ran). ``timeout_s``: the collective timeout of this cell (its time limit plus the pool's
    margin), so a cell given a longer limit than the pool's may also wait that long in a collective
    and a shorter one comes back sooner from a hang; the default group and teaching mode's side
    group both get it, since a rank waits in the side group's exchange first."""
    # IPython and torch on the engine only: the notebook's kernel imports this module to send it
    from IPython import get_ipython
    from torch.distributed import distributed_c10d as c10d

    from course_lib.parallel.collective_check import side_group

    if prompt is not None:
        get_ipython().execution_count = prompt
    # torch's own setter: gloo and NCCL read it for each collective that follows, no new group
    # needed. Private (torch 2.9 to 2.13 have it): feature-detected; without it the pool's stays
    set_timeout = getattr(c10d, "_set_pg_timeout", None)
    if set_timeout is None or not c10d.is_initialized():
        return
    set_timeout(timedelta(seconds=timeout_s))
    if side_group() is not None:
        set_timeout(timedelta(seconds=timeout_s), side_group())


def flight() -> list[dict]:
    from course_lib.parallel.collective_check import flight_record  # torch: ranks only

    return flight_record()


def _parent_of_engine(rest: list[str]) -> None:
    """Run the engine as a child; forward SIGINT/SIGTERM; record its exit status; exit with it."""
    folder = os.environ.get("COURSE_RANKS_DIR")
    # the engine's output in a file of the pool's (ipyparallel deletes its own log of a dead engine)
    log = open(os.path.join(folder, f"engine.{os.getpid()}.log"), "ab") if folder else None  # noqa: SIM115
    child = subprocess.Popen([sys.executable, "-m", "course_lib.launch.rank_pool_engine", "engine-child", *rest],
                             stdout=log, stderr=log)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    if folder:
        tmp = os.path.join(folder, f".exit.{child.pid}")
        with open(tmp, "w") as f:
            f.write(str(code))
        os.replace(tmp, os.path.join(folder, f"exit.{child.pid}"))
    sys.exit(code if code >= 0 else 128 - code)


def _user_namespace() -> dict:
    from IPython import get_ipython  # the engine is an IPython kernel: cells run in its user_ns

    return get_ipython().user_ns


def _watch_parent(parent: int, every_s: float = 0.5, folder: str | None = None) -> None:
    """Once ``parent`` is gone (this process was reparented), kill this process's descendants
    (the controller forks its schedulers, an engine its nanny) and exit: no orphaned ranks. The
    controller also removes the pool's ``folder`` (logs, exit statuses, the store), which the
    killed kernel could not; the engines, exiting too, may still write there for a moment."""
    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)

        kill_quietly(descendants(os.getpid()))
        for _ in range(10) if folder else ():  # each engine notices within every_s, then exits
            shutil.rmtree(folder, ignore_errors=True)
            time.sleep(every_s)
            if not os.path.exists(folder):
                break
        os._exit(3)
    threading.Thread(target=watch, name="course-parent-watch", daemon=True).start()


def main(argv: list[str]) -> None:
    role, rest = argv[0], argv[1:]
    if role not in ("engine", "engine-child", "controller"):
        sys.exit("usage: python -m course_lib.launch.rank_pool_engine engine|controller [args]")
    _watch_parent(os.getppid(), folder=os.environ.get("COURSE_RANKS_DIR") if role == "controller" else None)
    if role == "engine":
        _parent_of_engine(rest)
    if role == "engine-child":
        import torch.distributed  # noqa: F401 - every engine needs it; a spare engine is then ready at once
    role = role.removesuffix("-child")
    sys.argv = [f"ipyparallel.{role}", *rest]
    runpy.run_module(f"ipyparallel.{role}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
