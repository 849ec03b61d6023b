"""Start and stop process trees so that nothing is left behind.

A launch starts one process (torchrun's agent, or mpiexec) that starts the workers. Three rules
keep a notebook kernel from leaking processes:

* the child runs in its own session (``start_new_session``): the kernel's SIGINT (the stop
  button) and a terminal's Ctrl-C reach only the kernel, which then stops the tree in order;
* on Linux the child asks the kernel for a parent-death signal (``prctl(PR_SET_PDEATHSIG)``, see
  prctl(2)): when the thread that started it dies - a kernel restart, ``kill -9`` of the
  notebook - it gets SIGTERM, and torchrun turns that into stopping its workers;
* stopping is SIGTERM to the child's process group first (torchrun forwards it to its workers
  and waits for them), then SIGKILL to every process of the tree still alive after a grace period.

torchrun starts every worker in a session of its own, so the process group does not reach them;
:class:`ProcessTree` remembers each descendant while the tree is intact (a child whose parent
has died is re-parented to init and can no longer be found by walking down from the root).
No shell is involved anywhere: argument lists go to ``execve`` as they are.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

import psutil

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# The parent-death signal the launcher asks for; torchrun and mpiexec both stop their workers
# on SIGTERM, SIGKILL would orphan them.
DEFAULT_DEATH_SIGNAL = signal.SIGTERM


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def reset_locks_after_fork() -> None:
    """In a forked child: give tqdm new locks. A fork copies only the calling thread, so a lock that
    another thread of the parent held at that moment stays held forever in the child; tqdm's
    monitor thread takes tqdm's lock every 10 s, and every bar (a disabled one too) takes it, so
    a rank forked at the wrong moment hung at its first progress bar. Nothing to do without tqdm."""
    std = sys.modules.get("tqdm.std")
    if std is None:
        return
    lock_cls = std.TqdmDefaultWriteLock
    lock_cls.th_lock = std.TRLock()
    if "mp_lock" in vars(lock_cls):
        del lock_cls.mp_lock  # the next TqdmDefaultWriteLock makes this process its own
    lock = lock_cls()
    todo = [std.tqdm]
    while todo:  # tqdm and the subclasses (tqdm.auto, tqdm.notebook) that hold a lock of their own
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "_lock" in vars(cls):
            cls._lock = lock


def set_parent_death_signal(sig: int = DEFAULT_DEATH_SIGNAL, prctl=None) -> bool:
    """Ask Linux to send ``sig`` to this process when the thread that created it exits.

    Returns False where the call does not exist (macOS, Windows). Raises OSError if it fails.
    """
    prctl = prctl or _libc_prctl()
    if prctl is None:
        return False
    if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    return True


def _make_preexec(death_signal: int):
    """A function for Popen(preexec_fn=...): set the death signal, exit if the parent is gone.

    libc's prctl is looked up here, in the parent, so the child (between fork and exec) only
    makes one foreign call and never runs dlopen.
    """
    prctl = _libc_prctl()
    parent = os.getpid()

    def preexec():
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def spawn(argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
          stdout=None, stderr=None, death_signal: int | None = DEFAULT_DEATH_SIGNAL) -> subprocess.Popen:
    """Start ``argv`` (a list, no shell) in a new session with a parent-death signal.

    Call it from a thread that outlives the child (the notebook kernel runs cells on its main
    thread): Linux delivers the death signal when the creating *thread* exits.
    """
    if isinstance(argv, (str, bytes)):
        raise TypeError("argv must be a list of arguments, not a string (no shell is used)")
    preexec = _make_preexec(death_signal) if death_signal and sys.platform.startswith("linux") else None
    return subprocess.Popen(
        [os.fspath(a) for a in argv], env=None if env is None else dict(env), cwd=cwd,
        stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
        start_new_session=True, close_fds=True,
        preexec_fn=preexec,  # noqa: PLW1509 - one prctl call, resolved before the fork
    )


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie (exited, not yet reaped) counts as gone."""
    try:
        return _alive(psutil.Process(pid))
    except psutil.Error:
        return False


def descendants(pid: int) -> list[psutil.Process]:
    """The live children of process ``pid``, theirs, and so on (none if it is gone). Ask while it
    lives: once it is killed its children belong to init, and no walk from ``pid`` finds them."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_quietly(procs: list[psutil.Process]) -> None:
    """SIGKILL each of ``procs``, where one already gone is not an error (psutil checks that a pid
    is still the process it was, so a reused pid is left alone)."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def signal_name(exitcode: int | None) -> str | None:
    """'SIGKILL' for -9 (a process killed by a signal has a negative exit code); a signal without
    a name (a real-time one, SIGRTMIN + n) is 'signal N'."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def signal_quietly(pid: int, sig: int) -> None:
    """``os.kill(pid, sig)``, where a process already gone is not an error."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class ProcessTree:
    """A started process and every descendant seen so far (call :meth:`refresh` regularly)."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.known: dict[int, psutil.Process] = {}
        self.refresh()

    def refresh(self) -> None:
        try:
            root = psutil.Process(self.popen.pid)
        except psutil.Error:
            return
        for p in [root, *descendants(root.pid)]:
            self.known.setdefault(p.pid, p)

    def alive(self) -> list[psutil.Process]:
        return [p for p in self.known.values() if _alive(p)]

    def terminate(self, grace: float = 5.0) -> list[int]:
        """SIGTERM the root's process group, wait up to ``grace`` s, then SIGKILL what is left.

        Returns the pids that had to be killed. Safe to call more than once.
        """
        self.refresh()
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)  # the root leads its own session
            except (ProcessLookupError, PermissionError):
                pass
        else:  # the root is gone (crashed?): nobody will stop its workers but us
            for p in self.alive():
                try:
                    p.terminate()
                except psutil.Error:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            self.popen.poll()  # reap the root so it does not linger as a zombie
            self.refresh()
            if not self.alive():
                break
            time.sleep(0.02)
        killed = []
        for p in self.alive():
            try:
                p.kill()
                killed.append(p.pid)
            except psutil.Error:
                pass
        if killed:
            psutil.wait_procs([self.known[pid] for pid in killed], timeout=2.0)
        try:
            self.popen.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        return killed


def find_by_env(key: str, value: str) -> list[psutil.Process]:
    """Live processes of this user whose environment has ``key=value`` (leak checks in tests)."""
    found = []
    me = os.getuid()
    for p in psutil.process_iter(["uids"]):
        try:
            if p.info["uids"] is None or p.info["uids"].real != me or p.pid == os.getpid():
                continue
            if p.environ().get(key) == value and _alive(p):
                found.append(p)
        except psutil.Error:
            continue
    return found
