"""The local rank runners (run_local, run_ranks) on real ranks, for what a student or a test author
hits at the edges: an error that comes late is still that error, not a hang; a rank's own child
processes stop with the rank; the last words a rank prints without a newline reach the caller.

    python -m pytest tests/test_runners_audit.py -q
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from course_lib.launch.procs import pid_alive
from course_lib.launch.ranks import RankError, RanksTimeoutError, run_local
from course_lib.launch.spawn import run_ranks


def _fails_after_the_timeout(rank, world_size):
    time.sleep(1.5)  # longer than the collective timeout, but no collective: a plain bug
    raise ValueError("wrong shape on purpose")


@pytest.mark.timeout(60)
def test_an_error_raised_after_the_collective_timeout_is_that_error_not_a_hang():
    """run_ranks judged by the clock alone: any error raised later than ``timeout`` became "did not
    finish ... is there a collective that some rank never joined?", hiding the student's ValueError."""
    with pytest.raises(RankError, match="rank 0 failed: ValueError: wrong shape on purpose") as e:
        run_ranks(_fails_after_the_timeout, 1, timeout=1)
    assert not isinstance(e.value, RanksTimeoutError)


def _starts_a_child_and_hangs(pid_file):
    # a worker of the rank's own (a DataLoader worker, a subprocess) that outlives nothing by itself
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    time.sleep(60)


@pytest.mark.timeout(60)
def test_a_ranks_own_children_are_stopped_with_it_after_a_time_limit(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(RanksTimeoutError):
        run_local(_starts_a_child_and_hangs, 1, (str(pid_file),), backend=None, time_limit=2)
    pid = int(pid_file.read_text())
    try:
        deadline = time.monotonic() + 3.0  # SIGKILL is immediate; the zombie's reaping is not ours
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(pid), "the rank's child process was left running after the time limit"
    finally:
        if pid_alive(pid):
            psutil.Process(pid).kill()


def _prints_without_a_newline(rank, world_size):
    print(f"progress of rank {rank}: 100%", end="")  # a progress line redrawn in place
    return rank


@pytest.mark.timeout(60)
def test_the_last_line_a_rank_prints_without_a_newline_reaches_the_caller(capfd):
    assert run_ranks(_prints_without_a_newline, 2) == [0, 1]
    out = capfd.readouterr().out
    assert "[rank0] progress of rank 0: 100%" in out and "[rank1] progress of rank 1: 100%" in out


def _faulthandler_and_encoding(rank: int, world_size: int) -> tuple:
    faulthandler.enable()  # as a student debugging a hang might: needs sys.stderr.fileno() (AttributeError before)
    enabled = faulthandler.is_enabled()
    faulthandler.disable()
    return enabled, sys.stdout.encoding, sys.stderr.fileno()


@pytest.mark.timeout(60)
def test_faulthandler_can_be_enabled_inside_a_rank():
    assert run_ranks(_faulthandler_and_encoding, 2, timeout=30) == [(True, "utf-8", 2)] * 2


def _killed_by_a_real_time_signal(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGRTMIN + 1)  # default action: terminate; no name in signal.Signals
    time.sleep(30)


@pytest.mark.timeout(60)
def test_a_rank_killed_by_a_signal_without_a_name_is_reported():
    """signal.Signals(-exitcode) raised ValueError for a real-time signal: the report itself crashed."""
    with pytest.raises(RankError, match=rf"rank 1 failed: the process was killed by signal {int(signal.SIGRTMIN) + 1} "):
        run_ranks(_killed_by_a_real_time_signal, 2, timeout=30)


class _TwoArgumentError(Exception):
    def __init__(self, a, b):  # pickles (args = (a,)) but does not unpickle: __init__ needs two
        super().__init__(a)


def _returns_what_cannot_be_rebuilt(rank: int, world_size: int):
    return _TwoArgumentError("x", "y") if rank == 1 else rank


@pytest.mark.timeout(60)
def test_a_result_that_cannot_be_rebuilt_names_its_rank():
    """pickle.loads' raw TypeError came out of the runner, naming no rank."""
    with pytest.raises(RankError, match=r"rank 1 failed: its result was sent but cannot be rebuilt here \(TypeError"):
        run_ranks(_returns_what_cannot_be_rebuilt, 2, timeout=30)
