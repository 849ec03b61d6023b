"""python -m course_lib.launch.agent [torchrun options] TARGET [ARGS...]

torchrun, with one change for runs whose every node is this host: the TCP stores that torchrun
hosts (the c10d or static rendezvous store, and the store it shares with the workers) listen on
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
from datetime import timedelta

from course_lib.launch.procs import set_parent_death_signal

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
            super().__init__(host_name, port, world_size, is_master, timeout, wait_for_workers,
                             multi_tenant, master_listen_fd, use_libuv)

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
