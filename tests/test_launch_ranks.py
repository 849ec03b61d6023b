"""The one local rank runner (course_lib.launch.ranks) on real gloo ranks: functions of a notebook
cell travel by value, the ranks inherit nothing of the parent's state, what cannot be sent is
named before anything starts, hangs and failures name their ranks; the GPU case on a GPU.

    python -m pytest tests/test_launch_ranks.py -q
"""

from __future__ import annotations

import json
import re
import os
import sys
import threading

import pytest
import torch

from course_lib.launch import ranks
from course_lib.launch.ranks import RankError, RanksTimeoutError, SendError, run_local
from course_lib.launch.spawn import run_ranks

CELL = '''
import torch
import torch.distributed as dist

scale = 3.0

def cell_fn(rank, world_size):
    t = torch.full((2,), float(rank + 1)) * scale
    dist.all_reduce(t)
    return t
'''


def notebook_cell(source: str) -> dict:
    """The namespace a notebook cell leaves behind: its functions belong to ``__main__``, which a
    rank cannot import, so they must travel by value."""
    namespace = {"__name__": "__main__"}
    exec(compile(source, "<cell>", "exec"), namespace)  # noqa: S102 - the test's own source
    return namespace


@pytest.mark.timeout(120)
def test_a_notebook_function_and_a_closure_run_on_the_ranks():
    cell_fn = notebook_cell(CELL)["cell_fn"]
    assert cell_fn.__module__ == "__main__"
    expected = torch.full((2,), 3.0 * (1 + 2))  # what one process computes: the sum over ranks
    for got in run_ranks(cell_fn, 2, timeout=30):
        torch.testing.assert_close(got, expected)
    offset = torch.arange(3.0)

    def closure(rank, world_size):
        return offset + rank * world_size

    got = run_ranks(closure, 2, timeout=30)
    torch.testing.assert_close(got[1], offset + 2)  # a tensor, by value
    assert run_local(lambda a, b=1: a + b + int(os.environ["RANK"]), 2, (10,), {"b": 5}) == [15, 16]


def _module_state(*_rank):
    lock = getattr(json, "_course_test_lock", None)
    return getattr(json, "_course_test_mark", None), lock is not None and not lock.acquire(timeout=0.5)


@pytest.mark.timeout(120)
def test_ranks_do_not_inherit_the_parents_state(monkeypatch):
    """What the parent changed after its imports (an attribute, a lock a thread holds) is not in
    a rank; a forked rank, which copies the parent's memory, has both (it would hang on the lock)."""
    held, release = threading.Event(), threading.Event()
    lock = threading.Lock()

    def hold():
        with lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait()
    monkeypatch.setattr(json, "_course_test_mark", "parent", raising=False)
    monkeypatch.setattr(json, "_course_test_lock", lock, raising=False)
    try:
        assert run_ranks(_module_state, 2, timeout=30) == [(None, False)] * 2
        assert run_local(_module_state, 1, backend=None, method="fork") == [("parent", True)]
    finally:
        release.set()
        holder.join()


@pytest.mark.timeout(120)
def test_ranks_see_the_parents_environment_as_it_is_now(monkeypatch):
    run_local(int, 1, backend=None)  # the fork server runs, with the environment of then
    monkeypatch.setenv("COURSE_TEST_LATER", "set after the server started")
    got = run_local(lambda: (os.environ.get("COURSE_TEST_LATER"), os.environ["OMP_NUM_THREADS"],
                             torch.get_num_threads()), 2, threads=1)
    assert got == [("set after the server started", "1", 1)] * 2


@pytest.mark.timeout(60)
def test_what_cannot_be_sent_is_named_before_any_process_starts(monkeypatch, tmp_path):
    def no_start(method):
        raise AssertionError("no process may start")

    monkeypatch.setattr(ranks, "_context", no_start)
    lock = threading.Lock()
    with pytest.raises(SendError, match=r"cannot send argument 1 \(a lock\).*_thread.lock"):
        run_ranks(_module_state, 2, 1, lock)
    generator = (i for i in range(3))

    def uses_a_generator(rank, world_size):
        return next(generator)

    with pytest.raises(SendError, match=r"variable 'generator' of the function \(a generator\)"):
        run_ranks(uses_a_generator, 2)
    gen = (i for i in range(3))

    def calls_back(rank, world_size):  # the two call each other; the generator is one level down
        return uses_the_generator(rank) if rank < 0 else 0

    def uses_the_generator(rank):
        return calls_back(rank + 1, 0) + next(gen)

    with pytest.raises(SendError, match=r"variable 'gen' of variable 'uses_the_generator'"):
        run_ranks(calls_back, 2)
    with open(tmp_path / "log", "w") as f, pytest.raises(SendError, match=r"keyword argument 'file' \(a TextIOWrapper\)"):
        run_local(print, 2, kwargs={"file": f})


@pytest.mark.timeout(60)
def test_a_call_the_ranks_could_not_make_is_refused_before_any_process_starts(monkeypatch):
    """What a rank would only find out after starting (and the notebook_launcher, RankPool and
    grader front-ends with it): each once started processes, or failed with an internal error."""
    from course_lib.launch.forked import notebook_launcher
    from course_lib.launch.placement import LaunchConfigError
    from course_lib.launch.rank_pool import RankPool

    def no_start(method):
        raise AssertionError("no process may start")

    monkeypatch.setattr(ranks, "_context", no_start)
    for call, error, words in [
        (lambda: run_ranks(5, 2), TypeError, "fn must be a function, got 5"),
        (lambda: run_ranks(lambda: 1, 2), TypeError,
         r"each rank calls fn\(rank, world_size, \*args\), which <lambda>\(\) cannot take: too many positional"),
        (lambda: run_ranks(_fails_on_rank_one, 2, "extra"), TypeError,
         r"_fails_on_rank_one\(rank, world_size\) cannot take"),
        (lambda: run_ranks(_module_state, 2, timeout="10"), ValueError, "timeout must be a number of seconds > 0"),
        (lambda: run_ranks(_module_state, 2, threads=0), ValueError, "threads must be a whole number >= 1"),
        (lambda: run_ranks(_module_state, 2, start_method="bogus"), ValueError, "start method must be one of"),
        (lambda: notebook_launcher(print, (10.0), 2), TypeError, r"args must be a tuple of arguments, such as \(x,\)"),
        (lambda: notebook_launcher(print, "abc", 2), TypeError, "args must be a tuple"),
        (lambda: notebook_launcher(print, (), 2, kwargs=[1]), TypeError, "kwargs must be a dict"),
        (lambda: notebook_launcher(print, (), 2, timeout="60"), LaunchConfigError, "timeout must be a number"),
        (lambda: notebook_launcher(print, (), 2, threads=-1), ValueError, "threads must be"),
        (lambda: RankPool(2, gpus=0, threads=0), LaunchConfigError, "threads must be a whole number >= 1")]:
        with pytest.raises(error, match=words):
            call()


def _sleepy(rank, world_size):
    import time

    if rank == 1:
        time.sleep(60)
    return rank


def _fails_on_rank_one(rank, world_size):
    if rank == 1:
        print("about to fail")
        raise KeyError("missing on rank 1")
    return rank


@pytest.mark.timeout(120)
def test_a_time_limit_names_the_stuck_rank_and_a_failure_brings_its_traceback(capfd):
    with pytest.raises(RanksTimeoutError, match=r"time limit of 2 s reached; ranks \[1\] did not finish") as e:
        run_local(_sleepy, 2, pass_rank=True, time_limit=2)
    assert e.value.stuck == [1] and e.value.phase == "run"
    with pytest.raises(RankError, match="rank 1 failed: KeyError: 'missing on rank 1'") as e:
        run_ranks(_fails_on_rank_one, 2, timeout=30)
    assert e.value.rank == 1 and "in _fails_on_rank_one" in e.value.traceback
    assert "[rank1] about to fail" in capfd.readouterr().out


ANSWERS = '''
from course_lib.analysis.comm_cost import collective_time

def earlier(x):  # a wrong answer to an earlier question
    return 2 * x + 1

def later(x):
    return earlier(x) * 10

def ring_time():
    return collective_time("all_reduce", 1e6, 4, bandwidth=1e9, algorithm="ring")
'''


@pytest.mark.timeout(120)
def test_isolated_forbids_and_stands_in_for_notebook_functions(monkeypatch):
    """Answers defined in a notebook travel by value: the stand-ins and the forbidden functions
    still reach what the answer calls in the child, and the notebook keeps its own."""
    from course_lib.analysis import comm_cost
    from course_lib.exercises.grading import AnswerTimeoutError, isolated

    cell = notebook_cell(ANSWERS)
    later, ring_time = cell["later"], cell["ring_time"]
    assert isolated(lambda: later(3)) == 70
    assert isolated(lambda: later(3), stand_ins={later: {"earlier": lambda x: x}}) == 30
    assert later(3) == 70
    with pytest.raises(AssertionError, match="asks you to write yourself"):
        isolated(ring_time, forbid=[comm_cost.collective_time])
    assert ring_time() > 0
    with pytest.raises(AnswerTimeoutError, match="ran longer than 1 s"):
        isolated(lambda: threading.Event().wait(), timeout=1)
    draws = (i for i in range(3))  # an answer that keeps a generator: a failed check, named
    with pytest.raises(AssertionError, match=r"cannot be checked in a process of its own.*'draws'"):
        isolated(lambda: next(draws))


@pytest.mark.timeout(120)
def test_a_fresh_copy_of_the_grading_module_travels_by_name(monkeypatch):
    """The exercises' tests call ``grading`` from a copy that is not in ``sys.modules`` (otter's
    process may never import it): a rank imports it again rather than receive all it holds."""
    import importlib.util

    spec = importlib.util.find_spec("course_lib.exercises.grading")
    grading = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grading)
    monkeypatch.delitem(sys.modules, "course_lib.exercises.grading", raising=False)

    def check():
        grading.assert_number(grading.MAX_RANKS, 8, "MAX_RANKS")
        return grading.__name__

    assert grading.isolated(check) == "course_lib.exercises.grading"


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_after_a_cuda_backward_in_the_parent_every_front_end_runs():
    """On an H100 forked ranks died here: "Unable to handle autograd's threading in combination
    with fork-based multiprocessing" (a backward had run) or "CUDA error: initialization error"."""
    from course_lib.exercises.grading import isolated
    from course_lib.launch import notebook_launcher

    w = torch.ones(4, device="cuda", requires_grad=True)
    (w * w).sum().backward()  # CUDA initialised, autograd's device threads started
    assert torch.cuda.is_initialized()

    def on_gpu(rank, world_size):
        t = torch.full((2,), float(rank + 1))
        torch.distributed.all_reduce(t)
        x = torch.ones(3, device="cuda", requires_grad=True)
        (2 * x).sum().backward()
        return t, x.grad.cpu()

    for t, grad in run_ranks(on_gpu, 2, timeout=60):
        torch.testing.assert_close(t, torch.full((2,), 3.0))
        torch.testing.assert_close(grad, torch.full((3,), 2.0))
    assert notebook_launcher(lambda: torch.cuda.is_available(), nproc=2) == [True, True]
    assert isolated(lambda: torch.ones(2, device="cuda").sum().item()) == 2.0


def test_a_kernel_that_ran_ranks_shuts_down_by_itself(tmp_path):
    """ipykernel's shutdown waits for every child of its process group to go, and the fork
    server's resource tracker ignores SIGTERM: the kernel used to be killed by its frontend
    (jupyter_client: SIGTERM after 2.5 s) before its atexit handlers ran. The fork server and the
    tracker are stopped when the kernel is told to shut down, so it finishes its own shutdown."""
    pytest.importorskip("jupyter_client")
    import psutil
    from kernel_cells import run, start_kernel

    km, kc = start_kernel(tmp_path)
    try:
        cell = run(kc, "import atexit, os, psutil\n"
                       f"atexit.register(lambda: open({str(tmp_path / 'atexit')!r}, 'w').write('ran'))\n"
                       "from course_lib.launch.spawn import run_ranks\n"
                       "def f(rank, world_size):\n    return rank\n"
                       "print(run_ranks(f, 2))\n"
                       "print('helpers', [p.pid for p in psutil.Process().children()])")
        assert "[0, 1]" in cell.stdout, cell.stdout + cell.stderr
        helpers = [int(p) for p in re.findall(r"\d+", cell.stdout.split("helpers", 1)[1])]
        assert len(helpers) == 2  # the fork server and the resource tracker
    finally:
        kc.stop_channels()
        km.shutdown_kernel()  # graceful: the shutdown request, then jupyter_client's wait
    assert (tmp_path / "atexit").read_text() == "ran", "the kernel was killed, not shut down"
    assert not [p for p in helpers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_kernel_shutdown_stops_the_tracker_even_when_the_fork_servers_socket_is_gone(monkeypatch):
    """A kernel's shutdown stops the fork server, then the resource tracker (which would keep the
    kernel waiting); a socket file removed before the fork server's ``_stop`` unlinks it must
    not leave the tracker running."""
    stopped = []

    class Server:
        _forkserver_pid = None  # nothing to signal

        def _stop(self):
            stopped.append("server")
            raise FileNotFoundError(2, "No such file or directory", "/tmp/pymp-x/listener-y")

    class Tracker:
        def _stop(self):
            stopped.append("tracker")

    monkeypatch.setitem(sys.modules, "multiprocessing.forkserver", type(sys)("fake_forkserver"))
    monkeypatch.setitem(sys.modules, "multiprocessing.resource_tracker", type(sys)("fake_tracker"))
    sys.modules["multiprocessing.forkserver"]._forkserver = Server()
    sys.modules["multiprocessing.resource_tracker"]._resource_tracker = Tracker()
    ranks._stop_helpers({"new": False})
    assert stopped == []  # exit_now set back: nothing to do
    ranks._stop_helpers({"new": True})
    assert stopped == ["server", "tracker"]


def test_a_script_on_a_cluster_node_starts_its_ranks_and_a_failing_rank_names_its_lines(tmp_path):
    """A script's ranks, as on a cluster node: the job's $TMPDIR can be longer than a fork-server
    socket path may be (107 characters with the 32 that multiprocessing adds), and the fork server
    then failed to start ("AF_UNIX path too long") on Pythons that do not fall back to /tmp
    themselves; the ranks start, and still see the job's $TMPDIR as theirs. The script's functions
    travel by value (they belong to ``__main__``): a failing rank's traceback names the script's
    file and shows its lines, not cloudpickle's "<dynamic-code>"."""
    import subprocess

    long = tmp_path / ("scratch_of_a_cluster_job_" + "x" * 60)
    long.mkdir()
    assert len(str(long)) + ranks.FORKSERVER_SOCKET_TAIL > ranks.AF_UNIX_PATH_MAX
    script = tmp_path / "train_toy.py"
    script.write_text("import tempfile\nfrom course_lib.launch.spawn import run_ranks\n\n"
                      "def helper(x):\n    return x[5]\n\n"
                      "def show(rank, world_size):\n    return helper([rank])\n\n"
                      "def where(rank, world_size):\n    return tempfile.gettempdir()\n\n"
                      "if __name__ == '__main__':\n    print(run_ranks(where, 2, timeout=60))\n"
                      "    run_ranks(show, 2)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env={**os.environ, "TMPDIR": str(long)})
    assert proc.stdout.strip().splitlines()[0] == str([str(long)] * 2), proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 1 and "IndexError" in proc.stderr, proc.stderr[-3000:]
    assert f'File "{script}", line 8, in show\n    return helper([rank])\n' in proc.stderr, proc.stderr
    assert f'File "{script}", line 5, in helper\n    return x[5]\n' in proc.stderr, proc.stderr


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_a_ranks_traceback_names_the_notebook_cells_and_the_notebooks_ends_at_the_call(tmp_path):
    """cloudpickle names the file of the code it sends by value "<dynamic-code>": a failing rank
    said ``File "<dynamic-code>", line 3, in helper`` and showed no line. It now names the cell and
    shows the line, as the notebook does; and the notebook's own traceback ends at the student's
    call, without the runner's frames (spawn.py, ranks.py, grading.py, forked.py)."""
    pytest.importorskip("jupyter_client")
    from kernel_cells import run, start_kernel

    km, kc = start_kernel(tmp_path)
    try:
        helper = run(kc, "import torch\ndef helper(x):\n    return x[5]\n")
        cell = run(kc, "class Worker:\n    def m(self, r):\n        return helper([r])\n\n"
                       "def show(rank, world_size):\n    return Worker().m(rank)\n")
        fronts = {"run_ranks": "from course_lib.launch.spawn import run_ranks\nrun_ranks(show, 2)",
                  "grading": "from course_lib.exercises.grading import run_ranks\nrun_ranks(show, 2)",
                  "notebook_launcher": "from course_lib.launch import notebook_launcher\n"
                                       "notebook_launcher(show, args=(0, 1), nproc=1)"}
        for front, code in fronts.items():
            failed = run(kc, code)
            assert failed.error is not None, (front, failed.stdout, failed.stderr)
            rank_tb = failed.error["evalue"] + failed.stderr  # notebook_launcher prints it to stderr
            for frame, line in ((f"Cell In[{helper.execution_count}]\", line 3, in helper", "return x[5]"),
                                (f"Cell In[{cell.execution_count}]\", line 3, in m", "return helper([r])"),
                                (f"Cell In[{cell.execution_count}]\", line 6, in show", "return Worker().m(rank)")):
                assert f'File "{frame}\n    {line}\n' in rank_tb, (front, rank_tb)
            assert "<dynamic-code>" not in rank_tb, (front, rank_tb)
            shown = ANSI.sub("", "\n".join(failed.error["traceback"]))
            assert f"Cell In[{failed.execution_count}], line 2" in shown, (front, shown)
            for own in ("spawn.py", "ranks.py", "grading.py", "forked.py"):
                assert own not in shown, (front, own, shown)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_graders_test_that_calls_a_cells_function_names_the_cell_in_the_ranks_traceback(tmp_path):
    """otter runs an exercise's test as code compiled from the test's file, and hands it the
    student's function: the test's own function, sent by value, calls the cell's. The rank's
    traceback names the student's cell and shows its line (it said ``File "<dynamic-code>"``
    there too), and names the test's file, without its line (a hidden test's lines must not reach
    a student), where it said "<dynamic-code>"."""
    pytest.importorskip("jupyter_client")
    from kernel_cells import run, start_kernel

    test = ("def test(ring):\n"
            "    def worker(rank, world_size):\n"
            "        return ring(rank)  # the grader's line\n"
            "    return run_ranks(worker, 2)\n")
    (tmp_path / "q1_ring.py").write_text(test)  # readable by the ranks under the name they print, and still not shown
    km, kc = start_kernel(tmp_path)
    try:
        answer = run(kc, "def ring(x):\n    return sorted([x], key=lambda v: [v][3])\n")
        failed = run(kc, "from course_lib.exercises.grading import run_ranks\n"
                         "env = {'run_ranks': run_ranks}\n"
                         "exec(compile(open('q1_ring.py').read(), 'q1_ring.py', 'exec'), env)\n"
                         "env['test'](ring)")
        assert failed.error is not None, (failed.stdout, failed.stderr)
        rank_tb = failed.error["evalue"]
        assert 'File "q1_ring.py", line 3, in worker\n  File' in rank_tb, rank_tb  # the grader's: no line
        assert "the grader's line" not in rank_tb and "<dynamic-code>" not in rank_tb, rank_tb
        for frame in ("line 2, in ring", "line 2, in <lambda>"):
            assert (f'File "Cell In[{answer.execution_count}]", {frame}\n'
                    f"    return sorted([x], key=lambda v: [v][3])\n") in rank_tb, rank_tb
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
