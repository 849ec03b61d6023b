"""%%torchrun and %%mpirun through a real Jupyter kernel: output, failures, a killed rank, the
stop button, a kernel restart and a kernel shutdown - and the process table after each.

One kernel serves every test (kernels and torch imports are slow); the tests run in file order
and the last one shuts the kernel down. Every cell passes ``--env COURSE_TEST_MARKER=...`` so
the launched processes (agents and workers, not the kernel) can be found afterwards.
"""

import re
import signal
import time
import uuid

import pytest
from kernel_cells import Cell, run, start_kernel

from course_lib.hardware import gpu_count
from course_lib.launch.placement import plan_ranks
from course_lib.launch.procs import find_by_env

jupyter_client = pytest.importorskip("jupyter_client")
MARK = "COURSE_TEST_MARKER"


def _wait_gone(marker: str, within: float = 20.0) -> list:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        left = find_by_env(MARK, marker)
        if not left:
            return []
        time.sleep(0.1)
    return [(p.pid, p.cmdline()[:4]) for p in find_by_env(MARK, marker)]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    km, kc = start_kernel(tmp_path_factory.mktemp("kernel"))
    state = {"km": km, "kc": kc}
    run(kc, "%load_ext course_lib")
    yield state
    kc.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=True)


def _ranks_ready(n):
    return lambda cell: len(re.findall(r"ready (\d+)", cell.stdout)) >= n


def _sleeping_ranks(kernel, marker: str) -> Cell:
    """Start a 2-rank %%torchrun cell whose ranks sleep (tagged with ``marker``); return once both run."""
    cell = Cell(kernel["kc"], f"%%torchrun -n 2 --env {MARK}={marker}\n"
                              "import time\n"
                              "print('ready', RANK, flush=True)\n"
                              "time.sleep(120)\n")
    cell.pump(until=_ranks_ready(2))
    return cell


@pytest.mark.timeout(150)
def test_torchrun_cell_runs_on_two_ranks(kernel):
    marker = uuid.uuid4().hex
    cell = run(kernel["kc"], f"%%torchrun -n 2 --env {MARK}={marker}\n"
                              "t = torch.ones(2) * (RANK + 1)\n"
                              "dist.all_reduce(t)\n"
                              "print(RANK, WORLD_SIZE, LOCAL_RANK, t.tolist())\n")
    assert cell.error is None, cell.error
    assert "[rank0] 0 2 0 [3.0, 3.0]" in cell.stdout and "[rank1] 1 2 1 [3.0, 3.0]" in cell.stdout
    plan = plan_ranks(gpu_count(), 2, recipe="cell.py").line()  # "cpu, cpu · gloo" here; on one GPU both share cuda:0
    # the plan is news, not an error: with the ranks' lines (stdout), not in red among stderr's
    assert cell.stdout.count("[launch] plan: ") == 1 and f"[launch] {plan}\n" in cell.stdout and "plan" not in cell.stderr
    check = run(kernel["kc"], "print(torchrun_result.ok, torchrun_result.nproc, torchrun_result.run_dir.name)")
    assert check.stdout.startswith("True 2 ")
    assert _wait_gone(marker, 0) == []


@pytest.mark.timeout(60)
def test_a_plan_that_cannot_work_is_a_usage_error(kernel):
    cell = run(kernel["kc"], "%%torchrun -n 2 --device cpu --backend nccl\nprint('never')\n")
    assert "UsageError: NCCL runs on GPUs only" in cell.stderr and "never" not in cell.stdout  # IPython's one line


@pytest.mark.parametrize("parser,line", [("torchrun_parser", "--timeout 0"), ("torchrun_parser", "--time-limit -5"),
                                         ("mpirun_parser", "--timeout abc"), ("_line_parser", "start 2 --timeout nan"),
                                         ("torchrun_parser", "--timeout inf"),
                                         ("_cell_parser", "--timeout 0")])
def test_a_timeout_that_is_not_seconds_is_named_by_its_flag(parser, line):
    """Refused while the magic's line is read, named as the student typed it (it once reached the
    launcher as "collective_timeout must be ...")."""
    from IPython.core.error import UsageError

    from course_lib.launch import magics

    flag, value = re.search(r"(--[a-z-]+) (\S+)", line).groups()
    with pytest.raises(UsageError, match=rf"argument [^:]*{flag}: expected seconds > 0, got '{value}'"):
        getattr(magics, parser)().parse_args(line.split())


@pytest.mark.timeout(60)
def test_mpirun_cell(kernel):
    marker = uuid.uuid4().hex
    cell = run(kernel["kc"], f"%%mpirun -n 3 --env {MARK}={marker}\n"
                              "print(RANK, WORLD_SIZE, comm.allreduce(RANK + 1))\n")
    assert cell.error is None, cell.error
    for r in range(3):
        assert f"[rank{r}] {r} 3 6" in cell.stdout
    assert _wait_gone(marker, 0) == []


@pytest.mark.timeout(150)
def test_failing_rank_is_named_with_traceback(kernel):
    marker = uuid.uuid4().hex
    cell = run(kernel["kc"], f"%%torchrun -n 2 --env {MARK}={marker}\n"
                              "x = 1\n"
                              "if RANK == 1:\n"
                              "    x = 1 / 0\n"
                              "dist.barrier()\n")
    assert cell.error is not None and cell.error["ename"] == "LaunchError"
    assert cell.error["evalue"].startswith("rank 1 failed (exit code 1): ZeroDivisionError: division by zero")
    assert "at cell.py:3: x = 1 / 0" in cell.error["evalue"]
    assert "[rank1] ZeroDivisionError: division by zero" in cell.stderr  # its traceback, live
    assert _wait_gone(marker, 0) == []


@pytest.mark.timeout(150)
def test_killed_rank_is_reported(kernel):
    marker = uuid.uuid4().hex
    cell = _sleeping_ranks(kernel, marker)
    victim = next(p for p in find_by_env(MARK, marker) if p.environ().get("RANK") == "1"
                  and "course_lib.launch.bootstrap" in p.cmdline())
    victim.send_signal(signal.SIGKILL)
    cell.pump()
    assert cell.error is not None and cell.error["ename"] == "LaunchError"
    assert cell.error["evalue"].startswith("rank 1 failed (killed by SIGKILL)")
    assert _wait_gone(marker, 0) == []


@pytest.mark.timeout(150)
def test_interrupt_stops_every_process(kernel):
    marker = uuid.uuid4().hex
    cell = _sleeping_ranks(kernel, marker)
    assert len(find_by_env(MARK, marker)) >= 3  # the agent and two workers
    kernel["km"].interrupt_kernel()
    cell.pump(timeout=30)
    assert cell.error is not None and cell.error["ename"] == "KeyboardInterrupt"
    assert "[launch] interrupted: run stopped in" in cell.stderr
    assert _wait_gone(marker, 0) == []  # gone before the cell returned


def _start_sleeping_cell(kernel, marker) -> list[int]:
    _sleeping_ranks(kernel, marker)
    pids = [p.pid for p in find_by_env(MARK, marker)]
    assert len(pids) >= 3
    return pids


@pytest.mark.timeout(150)
def test_kernel_restart_leaves_no_process(kernel):
    marker = uuid.uuid4().hex
    _start_sleeping_cell(kernel, marker)
    kernel["km"].restart_kernel(now=True)  # the kernel is killed, as by "Restart" on a busy kernel
    assert _wait_gone(marker) == []
    kernel["kc"].wait_for_ready(timeout=60)
    run(kernel["kc"], "%load_ext course_lib")


@pytest.mark.timeout(150)
def test_kernel_shutdown_leaves_no_process(kernel):
    marker = uuid.uuid4().hex
    _start_sleeping_cell(kernel, marker)
    kernel["km"].shutdown_kernel(now=False)  # the polite way: a shutdown request first
    assert not kernel["km"].is_alive()
    assert _wait_gone(marker) == []


@pytest.mark.parametrize("magic,line", [("torchrun", "-n 0"), ("torchrun", "-n 2 --nnodes 0"),
                                        ("torchrun", "-n 2 --ranks -1"), ("torchrun", "-n 2 --env =x"),
                                        ("mpirun", "-n 0")])
def test_a_refused_cell_leaves_no_folder_behind(tmp_path, monkeypatch, magic, line):
    """The cell was saved as RUN_DIR/cell.py before the launch was checked: every refused cell left
    a runs/torchrun/TIMESTAMP folder behind (or replaced the cell.py of a --run-dir given)."""
    from IPython.core.error import UsageError

    from course_lib.launch.magics import LaunchMagics

    monkeypatch.chdir(tmp_path)
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "cell.py").write_text("the last cell")
    magics = LaunchMagics(shell=None)
    for extra in ("", " --run-dir kept", " --run-dir new/run"):
        with pytest.raises(UsageError):
            getattr(magics, magic)(line + extra, "print('never')\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    assert [p.name for p in kept.iterdir()] == ["cell.py"] and (kept / "cell.py").read_text() == "the last cell"


def test_a_run_dir_that_cannot_be_made_is_a_usage_error(tmp_path, monkeypatch):
    """--run-dir naming a file: a FileExistsError (or NotADirectoryError) once came out of the magic."""
    from IPython.core.error import UsageError

    from course_lib.launch.magics import LaunchMagics

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    for run_dir in ("a_file", "a_file/run"):
        with pytest.raises(UsageError, match=rf"cannot write the run directory {run_dir} .*choose another --run-dir"):
            LaunchMagics(shell=None).torchrun(f"-n 1 --run-dir {run_dir}", "print('never')\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
