"""python -m course_lib.launch.torchrun [torchrun options] TARGET [ARGS...]   (the agent process)

torchrun command lines: one node on 127.0.0.1, several nodes with a c10d rendezvous; and the
torchrun we run for them.

Single node (what a notebook uses): the rendezvous endpoint is ``127.0.0.1:0`` and the agent
hosts the store, binding a free port as it starts (as ``torchrun --standalone`` does; the workers
learn the port from the agent), so no port is picked ahead and lost to another process while the
agent imports torch; :func:`main` (the agent) makes that store listen on loopback only.
``c10d`` (the dynamic rendezvous) and ``static`` (``--master-addr/--master-port``, a free port
picked ahead: the static rendezvous cannot start on port 0) both work.

Multi-node: every node runs the same command; the agents meet at ``--rdzv-endpoint HOST:PORT``
(the first node, which hosts the store) under a unique ``--rdzv-id`` so two jobs sharing nodes
never join each other's rendezvous, and give up after an explicit join timeout instead of
torchrun's 600 s default. Reference: https://docs.pytorch.org/docs/stable/elastic/run.html

Nothing here runs a shell: each function returns a list of arguments. The flags are written in
today's spelling; :func:`fit_to_torchrun` then rewrites them for the torchrun that is installed
(read from its own parser, never from a version number): older releases spell some options with
underscores only, and some options do not exist in every release (torch 2.11's torchrun rejects
``--shutdown-timeout``), so those are left out where the course does the same job itself.

The agent (:func:`main`, what ``python -m course_lib.launch.torchrun`` runs) is torchrun, with one
change for runs whose every node is this host: the TCP stores that torchrun hosts (the c10d or static rendezvous store, and the store it shares with the workers) listen on
127.0.0.1 only, so students sharing a JupyterHub node expose nothing to the network.

PyTorch's TCPStore server binds every interface (``::``) whatever host name it is given; the
one way to choose the address is ``master_listen_fd``, a socket that is already bound and
listening. With ``COURSE_LOOPBACK_STORE=1`` in the environment, this module hands torchrun a
TCPStore subclass that binds such a socket to 127.0.0.1 when it is asked to be the server.
Multi-node runs on a cluster use the plain ``torchrun``: there the store must be reachable.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import traceback
import uuid
from collections.abc import Sequence
from datetime import timedelta

from course_lib.launch.placement import LaunchConfigError
from course_lib.launch.procs import set_parent_death_signal
from course_lib.utils import free_port

LOOPBACK = "127.0.0.1"
RDZV_BACKENDS = ("c10d", "static")
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")


# Options the launch works without, and who does their job then. Any other option missing from
# the installed torchrun is an error (the launch could not be what was asked).
OPTIONAL = {
    "--shutdown-timeout": "supervise.py's grace (SIGTERM, wait, SIGKILL) stops the workers",
    "--log-dir": "each rank's output is in RUN_DIR/logs already (bootstrap.py)",
    "--monitor-interval": "torchrun's own default only delays noticing that a worker ended",
    "--local-addr": "the agent then names itself by host name; one-host runs still meet on 127.0.0.1",
}


def installed_parser():
    """The installed torchrun's own argument parser (imports torch: call it when launching)."""
    from torch.distributed.run import get_args_parser  # why: seconds of import; never at import time

    return get_args_parser()


def accepted_options(parser=None) -> frozenset[str]:
    """Every option string (``--nproc-per-node``, ``--nproc_per_node``, ...) the parser accepts."""
    parser = installed_parser() if parser is None else parser
    # argparse keeps this table for its own lookups; every option string of every action is a key
    return frozenset(parser._option_string_actions)


def fit_to_torchrun(flags: Sequence[str], accepted: frozenset[str]) -> list[str]:
    """``flags`` (``--name=value``, today's hyphenated spelling) as the installed torchrun takes them.

    Each flag keeps its spelling if accepted, else takes the underscore one (older releases);
    a flag in :data:`OPTIONAL` that neither spelling names is left out; any other raises
    LaunchConfigError before anything starts.
    """
    out = []
    for flag in flags:
        name, eq, value = flag.partition("=")
        spelling = next((s for s in (name, "--" + name[2:].replace("-", "_")) if s in accepted), None)
        if spelling is not None:
            out.append(spelling + eq + value)
        elif name not in OPTIONAL:
            raise LaunchConfigError(f"the installed torchrun does not accept {name} (needed for this launch); "
                                    "upgrade torch, or launch with fewer options")
    return out


def new_run_id() -> str:
    """A rendezvous id no other job shares (torchrun's default 'none' lets jobs collide)."""
    return f"course-{uuid.uuid4().hex[:12]}"


def common_flags(nproc_per_node: int, nnodes: int, shutdown_timeout: float, log_dir: str | None) -> list[str]:
    flags = [f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", "--max-restarts=0",
             "--monitor-interval=0.1", f"--shutdown-timeout={max(1, round(shutdown_timeout))}"]
    if log_dir:
        flags.append(f"--log-dir={log_dir}")  # torchrun's own error files, not in /tmp
    return flags


def single_node_flags(nproc_per_node: int, *, port: int | None = None, rdzv: str = "c10d",
                      run_id: str | None = None, join_timeout: float = 60.0,
                      shutdown_timeout: float = 5.0, log_dir: str | None = None) -> list[str]:
    """torchrun options for N workers on this host, rendezvous on 127.0.0.1:port. No port: c10d
    binds one as the agent starts (port 0), static gets a free one now."""
    if rdzv not in RDZV_BACKENDS:
        raise ValueError(f"rdzv must be one of {RDZV_BACKENDS}, got {rdzv!r}")
    flags = common_flags(nproc_per_node, 1, shutdown_timeout, log_dir)
    if rdzv == "static":
        flags += ["--rdzv-backend=static", f"--master-addr={LOOPBACK}",
                  f"--master-port={port or free_port(LOOPBACK)}", "--node-rank=0"]
    else:
        flags += ["--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:{port or 0}",
                  f"--rdzv-id={run_id or new_run_id()}",
                  f"--rdzv-conf=join_timeout={max(1, round(join_timeout))},is_host=1"]
    return flags + [f"--local-addr={LOOPBACK}"]


def multi_node_flags(nnodes: int, nproc_per_node: int, endpoint: str, run_id: str, *,
                     join_timeout: float = 300.0, is_host: bool | None = None,
                     local_addr: str | None = None, shutdown_timeout: float = 5.0,
                     log_dir: str | None = None) -> list[str]:
    """torchrun options for one of ``nnodes`` nodes meeting at ``endpoint`` (c10d rendezvous)."""
    if nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {nnodes}")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous endpoint must be HOST:PORT, got {endpoint!r}")
    if not run_id:
        raise ValueError("a multi-node rendezvous needs a run id shared by all nodes (e.g. the job id)")
    conf = f"join_timeout={max(1, round(join_timeout))}"
    if is_host is not None:
        conf += f",is_host={int(is_host)}"
    flags = common_flags(nproc_per_node, nnodes, shutdown_timeout, log_dir)
    flags += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
              f"--rdzv-conf={conf}"]
    if local_addr:
        flags.append(f"--local-addr={local_addr}")
    return flags


def agent_argv(flags: Sequence[str], loopback: bool = True) -> list[str]:
    """The agent program: our loopback-store torchrun for local runs, else plain torchrun."""
    if loopback:
        return [sys.executable, "-m", "course_lib.launch.torchrun", *flags]
    return [sys.executable, "-m", "torch.distributed.run", *flags]


def bootstrap_args(run_dir: str, target: str, args: Sequence[str], *, module: bool,
                   init_pg: str = "none", pg_timeout: float = 60.0, mpi: bool = False) -> list[str]:
    """``-m course_lib.launch.bootstrap ...``: what torchrun or mpiexec runs on each rank."""
    out = ["-m", "course_lib.launch.bootstrap", f"--run-dir={run_dir}", f"--init-pg={init_pg}",
           f"--pg-timeout={pg_timeout:g}"]
    if mpi:
        out.append("--mpi")
    if module:
        out.append("-m")
    # "--" keeps a target or argument that starts with "-" from being read as an option.
    return out + ["--", str(target), *map(str, args)]


def nccl_debug_env(level: str | None = None, subsys: str | None = None,
                   file: str | os.PathLike | None = None) -> dict[str, str]:
    """NCCL's debug switches (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html).

    ``level``: VERSION, WARN, INFO or TRACE; ``subsys``: e.g. "INIT,COLL" or "ALL";
    ``file``: where to write, ``%h`` (host) and ``%p`` (pid) are expanded by NCCL - keep ``%p``
    so ranks do not overwrite each other.
    """
    env = {}
    if level:
        if level.upper() not in NCCL_DEBUG_LEVELS:
            raise ValueError(f"NCCL debug level must be one of {NCCL_DEBUG_LEVELS}, got {level!r}")
        env["NCCL_DEBUG"] = level.upper()
    if subsys:
        env["NCCL_DEBUG_SUBSYS"] = subsys
    if file:
        env["NCCL_DEBUG_FILE"] = os.fspath(file)
    if (subsys or file) and not level:
        env["NCCL_DEBUG"] = "INFO"  # the other two switches do nothing without a level
    return env


def local_network_env() -> dict[str, str]:
    """Keep gloo's and NCCL's bootstrap sockets on the loopback interface for one-host runs."""
    if os.path.exists("/sys/class/net/lo"):
        return {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    return {}


# -- the agent: torchrun with its stores on loopback ------------------------------------------------

LOOPBACK_ENV = "COURSE_LOOPBACK_STORE"


def loopback_store_class():
    """A ``torch.distributed.TCPStore`` whose server side listens on 127.0.0.1 only."""
    import torch.distributed as dist  # torch in functions: main sets the parent-death signal first

    base = dist.TCPStore

    class LoopbackTCPStore(base):
        def __init__(self, host_name, port, world_size=None, is_master=False,
                     timeout=timedelta(seconds=300), wait_for_workers=True, multi_tenant=False,
                     master_listen_fd=None, use_libuv=True):
            if is_master and master_listen_fd is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind(("127.0.0.1", int(port)))
                    sock.listen(512)
                except OSError as e:
                    sock.close()
                    # torch's c10d backend retries as a client on RuntimeError (port taken).
                    raise RuntimeError(f"cannot listen on 127.0.0.1:{port}: {e}") from e
                port = sock.getsockname()[1]
                master_listen_fd = sock.detach()  # the store's server owns the socket now
            try:
                super().__init__(host_name, port, world_size, is_master, timeout, wait_for_workers,
                                 multi_tenant, master_listen_fd, use_libuv)
            except NotImplementedError:
                if master_listen_fd is None or not use_libuv:
                    raise
                # Older torch (2.6): the libuv server cannot take a listening socket, the legacy
                # one can; the fd is still ours (refused before it was used).
                super().__init__(host_name, port, world_size, is_master, timeout, wait_for_workers,
                                 multi_tenant, master_listen_fd, False)

    LoopbackTCPStore.__name__ = LoopbackTCPStore.__qualname__ = "LoopbackTCPStore"
    return base, LoopbackTCPStore


def install_loopback_store() -> None:
    """Make torch.distributed and torchrun's rendezvous modules create loopback stores."""
    import torch.distributed as dist  # (torch only after main has set the parent-death signal)
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous
    import torch.distributed.elastic.rendezvous.static_tcp_rendezvous  # noqa: F401

    base, loopback = loopback_store_class()
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(module, "TCPStore", None) is base:
            module.TCPStore = loopback
    dist.TCPStore = loopback


def main(argv: list[str] | None = None) -> None:
    # Belt and braces: the launcher sets this too (preexec); a hand-started agent gets it here.
    if os.environ.get("COURSE_PDEATHSIG") == "1":
        set_parent_death_signal()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where is the agent? (kill -USR1)
    if os.environ.get(LOOPBACK_ENV) == "1":
        install_loopback_store()
    from torch.distributed.run import main as torchrun_main  # seconds of import: after the signal

    code = 0
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - torchrun's failure summary is in the traceback
        traceback.print_exc()
        code = 1
    # torchrun has stopped its workers by now. Skip the interpreter's teardown: with torch
    # loaded it takes seconds on a busy machine, and it is all the stop button would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
