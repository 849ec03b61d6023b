"""python -m course_lib.launch.bootstrap --run-dir DIR [--init-pg auto] [-m] TARGET [ARGS...]

What every launched rank runs first (torchrun and mpiexec start this module, it then runs the
user's script or module in the same process):

* dies with its parent (Linux parent-death signal): if torchrun's agent is killed, no worker
  is left;
* sends its stdout and stderr straight to ``DIR/logs/rank{RANK}.out|.err`` (file descriptors,
  so C++ output and the last line before a crash are kept) - the launcher tails these files;
* optionally initialises the default process group with a short timeout (``%%torchrun``
  cells), or MPI (``%%mpirun`` cells), and passes RANK, WORLD_SIZE, LOCAL_RANK to the code;
  with ``COURSE_CHECK_COLLECTIVES=1`` (``%%torchrun --check``) in teaching mode;
* records its state in ``DIR/logs/rank{RANK}.json`` and, on an exception, writes the traceback
  and a plain-words diagnosis (collective timed out, a peer rank exited) to
  ``DIR/logs/rank{RANK}.error.json``;
* dumps every thread's Python stack on SIGUSR1 (faulthandler), so the launcher can show where
  a hung rank is waiting.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback

from course_lib.hardware import planned_device
from course_lib.launch.procs import set_parent_death_signal
from course_lib.utils import init_process_group

RANK_ENVS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
SIZE_ENVS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
LOCAL_RANK_ENVS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
CHECK_ENV = "COURSE_CHECK_COLLECTIVES"  # "1": compare every collective across ranks (parallel.collective_check)

# Substrings of exception texts from gloo, NCCL and the c10d store, and what they mean.
TIMEOUT_MARKS = ("Timed out waiting", "timed out", "Timeout", "DistStoreError",
                 "Watchdog caught collective operation timeout")
PEER_MARKS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "ECONNRESET", "communicator was aborted", "Connection refused")


def _first_env(names, default=None):
    for name in names:
        if os.environ.get(name, "") != "":
            return int(os.environ[name])
    return default


def diagnose(text: str, phase: str, timeout_s: float | None) -> tuple[str, str]:
    """(kind, hint) for an error text; kind is 'collective_timeout', 'peer_exited' or 'error'."""
    limit = f" after {timeout_s:g} s" if timeout_s else ""
    if any(m in text for m in TIMEOUT_MARKS):
        if phase == "init":
            return "collective_timeout", (
                f"init_process_group timed out{limit}: not every rank reached it (a rank crashed "
                "or is still starting). Check the other ranks' output.")
        return "collective_timeout", (
            f"a collective timed out{limit}: at least one rank never joined it (it is stuck, "
            "still computing, or skipped the call). Every rank must call the same collectives in "
            "the same order.")
    if any(m in text for m in PEER_MARKS):
        return "peer_exited", ("another rank exited or crashed while this one was waiting for it "
                               "in a collective (it finished early or skipped the call?)")
    return "error", ""


def _trim(tb, skip_files):
    """Drop the leading frames that belong to this bootstrap and runpy."""
    while tb is not None and tb.tb_frame.f_code.co_filename in skip_files:
        tb = tb.tb_next
    return tb


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _redirect(log_dir: str, rank: int) -> None:
    os.makedirs(log_dir, exist_ok=True)
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(os.path.join(log_dir, f"rank{rank}.{suffix}"),
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)


def _init_torch(backend: str, timeout_s: float, local_rank: int) -> dict:
    import torch  # only ranks that ask for a process group pay for torch (the launcher imports us too)
    import torch.distributed as dist

    planned = planned_device()  # the launcher's plan: device and backend of this rank
    device = planned[0] if planned else None
    if backend == "auto":
        backend = planned[1] if planned else ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and device is None:
        device = f"cuda:{local_rank}"
    if device and device.startswith("cuda"):
        torch.cuda.set_device(device)  # gloo ranks sharing a GPU too: their CUDA tensors live here
    init_process_group(backend, timeout_s=timeout_s, device=device)  # NCCL: bound to this rank's GPU
    if os.environ.get(CHECK_ENV) == "1":  # %%torchrun --check: teaching mode in every rank
        from course_lib.parallel.collective_check import install_collective_check  # torch: these ranks only

        install_collective_check(True, timeout_s)
    return {"torch": torch, "dist": dist, "DEVICE": torch.device(device or "cpu")}


def _init_mpi() -> dict:
    from mpi4py import MPI  # importing mpi4py.MPI initialises MPI: only --mpi ranks may

    comm = MPI.COMM_WORLD
    return {"MPI": MPI, "comm": comm, "RANK": comm.rank, "WORLD_SIZE": comm.size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.launch.bootstrap")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--init-pg", default="none", choices=["none", "auto", "gloo", "nccl"])
    p.add_argument("--pg-timeout", type=float, default=60.0, help="collective timeout, seconds")
    p.add_argument("--mpi", action="store_true", help="import mpi4py and pass comm to the code")
    p.add_argument("-m", dest="module", action="store_true", help="TARGET is a module name")
    p.add_argument("target")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    set_parent_death_signal(signal.SIGKILL)  # the agent stops us with SIGTERM; this is the backstop
    if os.getppid() == 1:
        return 1  # our parent died before the line above
    rank = _first_env(RANK_ENVS, 0)
    world_size = _first_env(SIZE_ENVS, 1)
    local_rank = _first_env(LOCAL_RANK_ENVS, rank)
    log_dir = os.path.join(a.run_dir, "logs")
    _redirect(log_dir, rank)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    status_path = os.path.join(log_dir, f"rank{rank}.json")
    status = {"rank": rank, "local_rank": local_rank, "world_size": world_size, "pid": os.getpid(),
              "host": socket.gethostname(), "started": time.time(), "state": "running"}
    _write_json(status_path, status)

    env = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": local_rank}
    phase, code, pg = "init", 0, None
    try:
        if a.init_pg != "none":
            pg = _init_torch(a.init_pg, a.pg_timeout, local_rank)
            env.update(pg)
        if a.mpi:
            env.update(_init_mpi())
        phase = "run"
        if a.module:
            sys.argv = [a.target, *a.args]
            runpy.run_module(a.target, init_globals=env, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(a.target)
            sys.argv = [a.target, *a.args]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, init_globals=env, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - every failure is recorded, then we exit non-zero
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
        skip = {__file__, runpy.__file__, "<frozen runpy>"}
        lines = traceback.format_exception(type(e), e, _trim(e.__traceback__, skip))
        text = "".join(lines)
        kind, hint = diagnose(f"{type(e).__name__}: {e}", phase, a.pg_timeout if pg else None)
        sys.stderr.write(text)
        if hint:
            sys.stderr.write(f"rank {rank}: {hint}\n")
        _write_json(os.path.join(log_dir, f"rank{rank}.error.json"), {
            "rank": rank, "type": type(e).__name__, "message": str(e)[:2000], "traceback": text,
            "kind": kind, "hint": hint, "phase": phase, "time": time.time()})
        if kind == "collective_timeout":
            time.sleep(0.5)  # keeps the others alive while the launcher asks where they are
    status.update(state="done" if code == 0 else "failed", exitcode=code, ended=time.time())
    _write_json(status_path, status)
    if code != 0 and "comm" in env:
        # MPI_Finalize at exit would wait for ranks blocked in a collective with us: abort the job.
        sys.stdout.flush()
        sys.stderr.flush()
        env["comm"].Abort(code)
    if pg is not None and code == 0 and pg["dist"].is_initialized():
        pg["dist"].destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
