"""A cell executing in a real Jupyter kernel, read message by message (tests of the magics), the
processes a test's kernel left behind, and the processes a test started."""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import time

import psutil

BACKGROUND_MARK = "COURSE_TEST_BACKGROUND"  # in the environment of every process of tests/grading_batch.py


class Cell:
    """A cell executing in the kernel; pump() reads its output until a condition or the end.

    ``stdout``/``stderr``: the streams; ``displays``: the latest text/plain of each display (by
    display id, updates included); ``error``: the error reply's content, if any; ``execution_count``:
    its prompt number."""

    def __init__(self, kc, code: str):
        self.kc, self.msg_id = kc, kc.execute(code)
        self.stdout = self.stderr = ""
        self.displays: dict[str, str] = {}
        self.error = None
        self.done = False
        self.execution_count = None  # the prompt number the notebook shows, In [n]

    @property
    def display_text(self) -> str:
        return "\n".join(self.displays.values())

    def pump(self, until=None, timeout: float = 90.0) -> Cell:
        deadline = time.monotonic() + timeout
        while not self.done and not (until and until(self)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell still running; output so far:\n{self.stdout}\n{self.stderr}")
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != self.msg_id:
                continue
            kind, c = msg["msg_type"], msg["content"]
            if kind == "execute_input":
                self.execution_count = c["execution_count"]
            elif kind == "stream":
                if c["name"] == "stdout":
                    self.stdout += c["text"]
                else:
                    self.stderr += c["text"]
            elif kind in ("display_data", "update_display_data", "execute_result"):
                key = c.get("transient", {}).get("display_id") or f"{kind}{len(self.displays)}"
                self.displays[key] = c["data"].get("text/plain", "")
            elif kind == "error":
                self.error = c
            elif kind == "status" and c["execution_state"] == "idle":
                self.done = True
        return self


def start_kernel(cwd):
    """A python3 kernel in ``cwd`` with this interpreter's bin/ first on PATH; (manager, client)."""
    from jupyter_client.manager import KernelManager

    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}")
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=env, cwd=str(cwd))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc


def run(kc, code, timeout=120) -> Cell:
    return Cell(kc, code).pump(timeout=timeout)


def left_behind(mark: str, value: str, timeout: float = 15.0) -> list[int]:
    """The pids of the processes whose environment holds ``mark=value`` (every process a test
    started with it, and their children) still alive ``timeout`` seconds on."""
    procs = []
    for p in psutil.process_iter(["environ"]):
        with contextlib.suppress(psutil.Error):  # another user's process, or one that just ended
            if (p.info["environ"] or {}).get(mark) == value:
                procs.append(p)
    return [p.pid for p in psutil.wait_procs(procs, timeout=timeout)[1]]


def spawned_here() -> set[int]:
    """The pids of this process's descendants, without those of the grading batch that runs beside
    the tests (tests/grading_batch.py marks each of its processes in its environment)."""
    pids = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # gone
            if not _in_batch(p):
                pids.add(p.pid)
    return pids


def _in_batch(p: psutil.Process) -> bool:
    try:
        return BACKGROUND_MARK in p.environ()
    except psutil.ZombieProcess:  # ended, not yet reaped, its environment gone: ask its parent
        parent = p.parent()
        return parent is not None and parent.pid != os.getpid() and _in_batch(parent)
