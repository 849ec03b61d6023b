"""Two pieces of grading and the rank pool, each with one home:

* a process tree is killed through ``course_lib.launch.procs`` (``descendants`` found before the
  kill, then ``kill_quietly``), not by a loop of its own in ``grade._kill_session`` and
  ``rank_pool_engine._watch_parent``: a child that started a grandchild is gone with it;
* ``course grade --cell-timeout`` reaches the grading workers through the environment given to
  them (``grade_many(cell_timeout=...)``), not by setting ``os.environ`` of the grader itself
  (a notebook that runs ``course grade`` would see it change, and a thread beside it too).

    python -m pytest tests/test_grading_kill_and_timeout.py -q
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from course_lib.exercises.cell_limit import CELL_TIMEOUT_ENV
from course_lib.exercises.grade import GradeReport, _kill_session, grade_many
from course_lib.launch.procs import kill_quietly, pid_alive

# the module: `from course_lib.exercises import cli` is its function of that name (the package re-exports it)
cli = importlib.import_module("course_lib.exercises.cli")
grade_module = importlib.import_module("course_lib.exercises.grade")

# A process that starts a child in a session of its own (as jupyter_client starts a kernel), which
# starts a grandchild (a rank); all sleep. 60 s: a leak outlives the test only by that much.
SLEEPER = "import time; time.sleep(60)"
CHILD = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]); time.sleep(60)"
TREE = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {CHILD!r}], "
        "start_new_session=True); time.sleep(60)")


def _family(pid: int, size: int, timeout: float = 20.0) -> list[psutil.Process]:
    """The ``size`` descendants of ``pid``, once they have all started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        family = psutil.Process(pid).children(recursive=True)
        if len(family) >= size:
            return family
        time.sleep(0.05)
    raise AssertionError(f"process {pid} started {len(family)} descendants, not {size}, in {timeout:g} s")


def _all_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids of ``pids`` still running after ``timeout`` s (a zombie counts as gone)."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


# -- 1. killing a process tree --------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_kill_session_kills_the_worker_its_child_in_another_session_and_the_grandchild():
    """The worker's process group holds the worker; its kernel (a session of its own) and the ranks
    the kernel started are found by the walk taken before the kill: none of them is left."""
    worker = subprocess.Popen([sys.executable, "-c", TREE], start_new_session=True)
    family = []
    try:
        family = _family(worker.pid, 2)
        _kill_session(worker)
        worker.wait(timeout=10)
        assert worker.returncode == -signal.SIGKILL
        assert _all_gone([p.pid for p in family]) == []
        _kill_session(worker)  # once more, all gone: not an error
    finally:
        worker.kill()
        kill_quietly(family)


# The parent the watch reports to, which the test kills: its child (a controller) watches it with
# _watch_parent and has started a tree; the parent prints the controller's pid.
WATCHED = textwrap.dedent(f"""
    import os, sys, time
    from course_lib.launch.rank_pool_engine import _watch_parent
    _watch_parent(os.getppid(), every_s=0.05)
    import subprocess
    subprocess.Popen([sys.executable, "-c", {CHILD!r}])
    time.sleep(60)
""")
PARENT = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {WATCHED!r}]); "
          "print(p.pid, flush=True); time.sleep(60)")


@pytest.mark.timeout(60)
def test_watch_parent_kills_the_watchers_tree_once_its_parent_is_gone():
    """A controller or engine whose parent (the kernel) died kills every process under it and
    exits: a child that started a grandchild leaves neither behind."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    family = []
    try:
        watcher = int(parent.stdout.readline())
        family = [psutil.Process(watcher), *_family(watcher, 2)]
        parent.kill()
        parent.wait(timeout=10)
        assert _all_gone([p.pid for p in family]) == [], "the watcher's tree outlived its parent"
    finally:
        parent.kill()
        kill_quietly(family)
        if parent.stdout:
            parent.stdout.close()


# -- 2. the cell timeout of `course grade` --------------------------------------------------------

@pytest.fixture
def workers(monkeypatch):
    """Each grading worker ``grade_many`` would start: the environment it was given, and the grader's
    own value of the cell timeout at that moment (no worker runs: a grading takes a minute)."""
    seen = []

    def fake_grade_in_process(submission, autograder, time_limit, env, seed=None, workers=None):
        seen.append({"env": dict(env), "grader": os.environ.get(CELL_TIMEOUT_ENV)})
        return GradeReport(submission, autograder, [])

    monkeypatch.setattr(grade_module, "_grade_in_process", fake_grade_in_process)
    return seen


@pytest.fixture
def environ_writes(monkeypatch):
    """Every write or removal of the cell timeout in this process's ``os.environ``."""
    writes = []
    cls = type(os.environ)
    setitem, delitem = cls.__setitem__, cls.__delitem__

    def spy_set(self, key, value):
        if key == CELL_TIMEOUT_ENV:
            writes.append(("set", value))
        setitem(self, key, value)

    def spy_del(self, key):
        if key == CELL_TIMEOUT_ENV:
            writes.append(("del",))
        delitem(self, key)

    monkeypatch.setattr(cls, "__setitem__", spy_set)
    monkeypatch.setattr(cls, "__delitem__", spy_del)
    return writes


@pytest.fixture
def submission(tmp_path):
    sub, zip_ = tmp_path / "ada.ipynb", tmp_path / "ag.zip"
    sub.write_text("{}")
    zip_.write_text("")
    return sub, zip_


@pytest.mark.timeout(30)
def test_course_grade_gives_the_cell_timeout_to_the_workers_not_to_its_own_environment(
        submission, workers, environ_writes, monkeypatch):
    monkeypatch.delenv(CELL_TIMEOUT_ENV, raising=False)
    environ_writes.clear()  # the line above is the test's own
    sub, zip_ = submission
    assert cli.grade_cli([str(sub), "--autograder", str(zip_), "--cell-timeout", "30", "--quiet"]) == 0
    assert len(workers) == 1
    assert workers[0]["env"][CELL_TIMEOUT_ENV] == "30.0"  # what the worker's plugin reads
    assert workers[0]["grader"] is None, "the grader's own os.environ carried the cell timeout while grading"
    assert environ_writes == []
    assert CELL_TIMEOUT_ENV not in os.environ


@pytest.mark.timeout(30)
def test_course_grade_passes_a_cell_timeout_set_in_the_environment_on_unchanged(
        submission, workers, environ_writes, monkeypatch):
    monkeypatch.setenv(CELL_TIMEOUT_ENV, "45")
    environ_writes.clear()
    sub, zip_ = submission
    assert cli.grade_cli([str(sub), "--autograder", str(zip_), "--quiet"]) == 0
    assert workers[0]["env"][CELL_TIMEOUT_ENV] == "45" and workers[0]["grader"] == "45"
    # the flag wins over the environment, for the workers only
    assert cli.grade_cli([str(sub), "--autograder", str(zip_), "--cell-timeout", "7", "--quiet"]) == 0
    assert workers[1]["env"][CELL_TIMEOUT_ENV] == "7.0" and workers[1]["grader"] == "45"
    assert environ_writes == [] and os.environ[CELL_TIMEOUT_ENV] == "45"


@pytest.mark.timeout(30)
def test_grade_many_takes_the_cell_timeout_as_an_argument(submission, workers, environ_writes, monkeypatch):
    monkeypatch.delenv(CELL_TIMEOUT_ENV, raising=False)
    environ_writes.clear()
    sub, zip_ = submission
    grade_many([sub], [zip_], cell_timeout=12)
    grade_many([sub], [zip_])
    assert workers[0]["env"][CELL_TIMEOUT_ENV] == "12"
    assert CELL_TIMEOUT_ENV not in workers[1]["env"]  # the exercise's own limit applies
    assert environ_writes == []
    for bad in (float("nan"), float("inf"), 0, 3e9):  # what the kernel's alarm cannot hold
        with pytest.raises(ValueError, match="cell_timeout"):
            grade_many([sub], [zip_], cell_timeout=bad)
    assert len(workers) == 2
