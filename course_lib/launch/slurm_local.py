"""python -m course_lib.launch.slurm_local [--dir runs/slurm-local] [--stop]   (make slurm-local)

A real two-node SLURM cluster on this one machine, to try ``course submit --scheduler slurm``
without a cluster. It runs ``munged`` (authentication), ``slurmctld`` (the controller) and two
``slurmd`` daemons (the nodes), every file in one folder, every port picked free:

- the two nodes are named after this host and ``localhost`` (a node name must resolve), both at
  NodeAddr 127.0.0.1 with their own slurmd Port (several ``slurmd -N NAME`` on one host);
- the plugins need no kernel support: ProctrackType=proctrack/linuxproc, TaskPlugin=task/none,
  SelectType=select/cons_tres, AccountingStorageType=accounting_storage/none;
- SlurmUser is the user that starts it. As root every job user works; as another user jobs run as
  that user only (slurmd cannot switch users).

Commands find the cluster through ``SLURM_CONF`` (``cluster.env``), e.g.
``SLURM_CONF=runs/slurm-local/slurm.conf sinfo``. Stopping kills every daemon by its pid.
Daemons and options: https://slurm.schedmd.com/slurm.conf.html, https://slurm.schedmd.com/slurmd.html,
munged(8). Debian packages: ``slurm-wlm`` and ``munge`` (``make slurm-deps``).
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.launch.procs import pid_alive, signal_quietly
from course_lib.utils import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")


class SlurmUnavailable(RuntimeError):
    """SLURM or munge is not installed, or its daemons did not start; the message says which."""


def missing_programs() -> list[str]:
    """The SLURM/munge programs not found on PATH (or in /usr/sbin, where Debian puts daemons)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [name for name in DAEMONS if shutil.which(name, path=path) is None]


def _which(name: str) -> str:
    exe = shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin")
    if exe is None:
        raise SlurmUnavailable(f"{name} not found: install Debian's slurm-wlm and munge (make slurm-deps)")
    return exe


def node_names() -> tuple[str, str]:
    """Two names that resolve to this machine: its host name and ``localhost``."""
    host = socket.gethostname().split(".")[0]
    if host == "localhost":
        raise SlurmUnavailable("this machine's host name is 'localhost'; two distinct node names are needed")
    for name in (host, "localhost"):
        try:
            socket.gethostbyname(name)
        except OSError:
            raise SlurmUnavailable(f"node name {name!r} does not resolve; add it to /etc/hosts") from None
    return host, "localhost"


def slurm_conf(root: Path, host: str, nodes: tuple[str, ...], ctld_port: int, node_ports: tuple[int, ...],
               user: str, munge_socket: Path, cpus: int) -> str:
    """slurm.conf for one controller on ``host`` and ``nodes`` on 127.0.0.1 (one port each)."""
    lines = [
        "ClusterName=course-local",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmUser={user}", f"SlurmdUser={user}",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd-%n.log",
        # no cgroups, no accounting daemon: what runs on a laptop or in a container
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none", "MpiDefault=none",
        "ReturnToService=2", "SchedulerType=sched/backfill",
        "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=5", "MinJobAge=600",
    ]
    lines += [f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN"
              for name, port in zip(nodes, node_ports)]
    lines.append(f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


@dataclass
class LocalSlurm:
    """A running local cluster: its folder, node names and daemon pids."""

    root: Path
    nodes: tuple[str, ...]
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose sbatch/srun/scontrol talk to this cluster (and find /usr/sbin)."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        done = subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout,
                              check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
        return done.stdout + done.stderr

    def job_state(self, job_id: str) -> tuple[str, str]:
        """(JobState, ExitCode) from ``scontrol show job`` (no accounting daemon: no sacct)."""
        text = self.run("scontrol", "show", "job", "-o", job_id)
        state = re.search(r"JobState=(\S+)", text)
        code = re.search(r"ExitCode=(\S+)", text)
        return (state.group(1) if state else "UNKNOWN"), (code.group(1) if code else "")

    def wait_job(self, job_id: str, timeout: float = 120.0) -> tuple[str, str]:
        """Wait until the job leaves PENDING/RUNNING/COMPLETING; returns (state, exit code)."""
        deadline = time.monotonic() + timeout
        while True:
            state, code = self.job_state(job_id)
            if state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
                return state, code
            if time.monotonic() > deadline:
                self.run("scancel", job_id, check=False)
                raise TimeoutError(f"SLURM job {job_id} still {state} after {timeout:.0f} s (cancelled)")
            time.sleep(0.5)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every daemon by pid (slurmd first, munged last), SIGKILL what is left."""
        order = sorted(self.pids, key=lambda name: (name.startswith("munged"), name.startswith("slurmctld")))
        for name in order:
            signal_quietly(self.pids[name], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name in order:
            while pid_alive(self.pids[name]) and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid_alive(self.pids[name]):
                signal_quietly(self.pids[name], signal.SIGKILL)
        self.pids.clear()


def _pid_from(path: Path, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            time.sleep(0.05)
    raise SlurmUnavailable(f"{path.name} did not appear within {timeout:.0f} s; see the logs in {path.parent}")


def start(root: str | os.PathLike, timeout: float = 20.0) -> LocalSlurm:
    """Start munged, slurmctld and two slurmd in ``root``; returns once both nodes are idle.

    Daemons run in the foreground (``-D``/``-F``) as our children in their own sessions, so their pids
    are known from the start and ``stop()`` reaches each one; on any failure everything started is
    stopped again."""
    root = Path(root).resolve()
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)
    host, nodes = socket.gethostname().split(".")[0], node_names()
    user = getpass.getuser()
    key = root / "munge" / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = root / "munge" / "munge.socket"
    ctld_port, ports = free_port(), (free_port(), free_port())
    (root / "slurm.conf").write_text(slurm_conf(root, host, nodes, ctld_port, ports, user, sock,
                                                max(1, os.cpu_count() or 1)))
    cluster = LocalSlurm(root, nodes)
    env = cluster.env()
    logs = root / "daemons.out"

    def spawn(name: str, argv: list[str]) -> None:
        with open(logs, "ab") as log:  # the daemon keeps its own copy of the descriptor
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        cluster.pids[name] = proc.pid

    try:
        spawn("munged", [_which("munged"), "-F", "--force", f"--socket={sock}", f"--key-file={key}",
                         f"--log-file={root / 'munge' / 'munged.log'}", f"--pid-file={root / 'munge' / 'munged.pid'}",
                         f"--seed-file={root / 'munge' / 'munged.seed'}"])
        _wait_for(lambda: sock.exists(), timeout, "munged did not open its socket", root)
        spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(cluster.conf)])
        for name in nodes:
            spawn(f"slurmd-{name}", [_which("slurmd"), "-D", "-N", name, "-f", str(cluster.conf)])
        _wait_for(lambda: _idle_nodes(cluster) >= len(nodes), timeout, "the nodes did not become idle", root)
    except BaseException:
        cluster.stop()
        raise
    (root / "cluster.env").write_text(f"export SLURM_CONF={cluster.conf}\n")
    (root / "pids").write_text("".join(f"{name} {pid}\n" for name, pid in cluster.pids.items()))
    return cluster


def _idle_nodes(cluster: LocalSlurm) -> int:
    try:
        out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=5)
    except subprocess.TimeoutExpired:
        return 0
    return sum(1 for line in out.splitlines() if line.split()[-1:] == ["idle"])


def _wait_for(ready, timeout: float, what: str, root: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise SlurmUnavailable(f"{what} within {timeout:.0f} s; see the logs in {root}")
        time.sleep(0.2)


def stop_leftovers(root: str | os.PathLike) -> list[int]:
    """Stop the daemons of a cluster whose starter died (pids from ROOT/pids); a pid is signalled
    only while its command line still names ROOT, so a reused pid is left alone."""
    root = Path(root).resolve()
    pids = {}
    if (root / "pids").exists():
        for line in (root / "pids").read_text().splitlines():
            name, pid = line.split()
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(root) in cmdline:
                pids[name] = int(pid)
    found = sorted(pids.values())
    LocalSlurm(root, (), pids).stop()
    return found


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.launch.slurm_local",
                                description="Start a two-node SLURM cluster on this machine; Ctrl-C stops it.")
    p.add_argument("--dir", default="runs/slurm-local", help="where its config, state and logs go")
    p.add_argument("--stop", action="store_true", help="stop the daemons a killed session left running in --dir")
    a = p.parse_args(argv)
    if a.stop:
        print(f"slurm-local: stopped pids {stop_leftovers(a.dir) or 'none'}")
        return 0
    try:
        cluster = start(a.dir)
    except SlurmUnavailable as e:
        print(f"slurm-local: {e}", file=sys.stderr)
        return 1
    print(f"SLURM cluster up: nodes {', '.join(cluster.nodes)} (logs in {cluster.root}).\n"
          f"In another terminal:\n  source {cluster.root / 'cluster.env'}\n  sinfo\n"
          "  course submit --scheduler slurm --nodes 2 --gpus-per-node 0 --nproc-per-node 1 -- "
          "--config=shakespeare_char_cpu --max_iters=50\n  squeue; cat course-train-*.out\n"
          "Ctrl-C here stops every daemon.", flush=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # delivered to sigwait below
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        cluster.stop()
        print("slurm-local: stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
