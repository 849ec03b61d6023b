"""launch() and mpirun() with real torchrun agents, gloo workers and mpiexec ranks on CPU.

Each test checks the process table afterwards: no process may keep the test's marker.
"""

import io
import json
import textwrap
import threading
import uuid

import pytest

from course_lib.launch import launch, mpirun
from course_lib.launch.procs import find_by_env

WEIRD_ARGS = ["a b", ";rm -rf /tmp/nothing", "$HOME", "--x=y z"]

WORKER = textwrap.dedent('''
    import json, os, sys
    import psutil
    t = torch.tensor([float(RANK + 1)])
    dist.all_reduce(t)  # the default process group was set up by the launcher
    me = psutil.Process()
    listening = sorted({c.laddr.ip for p in (me, me.parent()) for c in p.net_connections("tcp")
                        if c.status == "LISTEN"})
    print(json.dumps({"rank": RANK, "world": WORLD_SIZE, "local": LOCAL_RANK, "sum": t.item(),
                      "port": os.environ["MASTER_PORT"], "argv": sys.argv[1:],
                      "group_rank": os.environ.get("GROUP_RANK"),
                      "mark": os.environ["COURSE_TEST_MARKER"], "listen": listening,
                      "nccl": [os.environ.get(k) for k in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")],
                      "collective_timeout": os.environ["COURSE_COLLECTIVE_TIMEOUT"]}))
    print(f"stderr line from rank {RANK}", file=sys.stderr)
''')


@pytest.fixture
def marker():
    m = uuid.uuid4().hex
    yield m
    assert find_by_env("COURSE_TEST_MARKER", m) == [], "processes of the launch were left behind"


def _records(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.timeout(120)
def test_concurrent_launches_loopback_and_literal_args(tmp_path, marker, monkeypatch):
    """Three launches at once on this host (c10d, c10d, static): each gets its own port. Each
    rank's collective timeout is the launch's own, not one this process inherited."""
    monkeypatch.setenv("COURSE_COLLECTIVE_TIMEOUT", "7")  # e.g. the launcher is itself a rank
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results, outs, errs = {}, {}, {}

    def run(i, rdzv):
        outs[i], errs[i] = io.StringIO(), io.StringIO()
        nccl = {"nccl_debug": "WARN", "nccl_debug_subsys": "INIT,COLL",
                "nccl_debug_file": f"{tmp_path}/nccl.%h.%p"} if i == 0 else {}
        results[i] = launch(script, WEIRD_ARGS, nproc=2, init_process_group=True, rdzv=rdzv,
                            env={"COURSE_TEST_MARKER": marker}, run_dir=tmp_path / f"run{i}",
                            collective_timeout=60, out=outs[i], err=errs[i], **nccl)

    threads = [threading.Thread(target=run, args=(i, rdzv))
               for i, rdzv in enumerate(["c10d", "c10d", "static"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ports = set()
    for i, r in results.items():
        assert r.ok, r.error
        recs = [_records(r.stdout[k])[0] for k in (0, 1)]
        assert [x["rank"] for x in recs] == [0, 1] and {x["world"] for x in recs} == {2}
        assert [x["local"] for x in recs] == [0, 1]
        assert {x["sum"] for x in recs} == {3.0}  # 1 + 2, as one process would add them
        assert all(x["argv"] == WEIRD_ARGS and x["mark"] == marker for x in recs)
        assert all(x["listen"] == ["127.0.0.1"] for x in recs), recs  # agent and worker sockets
        ports.add(recs[0]["port"])
        shown = outs[i].getvalue()
        assert "[rank0] {" in shown and "[rank1] {" not in shown  # stdout: rank 0 only
        assert "[rank1] stderr line from rank 1" in errs[i].getvalue()  # errors: every rank
        assert (r.run_dir / "logs" / "rank1.out").read_text() == r.stdout[1]
        nccl = ["WARN", "INIT,COLL", f"{tmp_path}/nccl.%h.%p"] if i == 0 else [None, None, None]
        assert all(x["nccl"] == nccl for x in recs)  # NCCL's debug switches reach every rank
        assert all(x["collective_timeout"] == "60" for x in recs), recs
    assert len(ports) == 3


@pytest.mark.timeout(90)
def test_failure_names_rank_exit_code_and_traceback(tmp_path, marker):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent('''
        import time
        if RANK == 1:
            raise ValueError("boom on rank 1")
        dist.barrier()
        time.sleep(30)
    '''))
    err = io.StringIO()
    r = launch(script, nproc=2, init_process_group=True, env={"COURSE_TEST_MARKER": marker},
               run_dir=tmp_path / "run", out=io.StringIO(), err=err)
    assert not r.ok and r.returncode != 0
    assert r.failed_rank == 1 and r.failure.exitcode == 1 and r.failure.kind == "error"
    assert 'fail.py", line 4' in r.traceback and "ValueError: boom on rank 1" in r.traceback
    assert r.error.startswith("rank 1 failed (exit code 1): ValueError: boom on rank 1")
    assert "[launch] rank 1 failed: ValueError: boom on rank 1" in err.getvalue()
    assert "[rank1] ValueError: boom on rank 1" in err.getvalue()


@pytest.mark.timeout(90)
def test_collective_that_a_rank_never_joins_times_out(tmp_path, marker):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent('''
        import time
        if RANK == 1:
            time.sleep(120)  # never reaches the all_reduce
        dist.all_reduce(torch.ones(1))
    '''))
    r = launch(script, nproc=2, init_process_group=True, collective_timeout=3,
               env={"COURSE_TEST_MARKER": marker}, run_dir=tmp_path / "run",
               out=io.StringIO(), err=io.StringIO())
    assert not r.ok and r.failed_rank == 0 and r.failure.kind == "collective_timeout"
    assert "a collective timed out after 3 s" in r.error
    assert "hang.py:5: dist.all_reduce(torch.ones(1)) (in all_reduce)" in r.error
    assert "rank 1 did not join: it was at hang.py:4: time.sleep(120)" in r.error


@pytest.mark.timeout(90)
def test_two_nodes_rendezvous_on_this_host(tmp_path, marker):
    """Two torchrun agents, --nnodes=2, c10d rendezvous on 127.0.0.1, one worker each."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    r = launch(script, ["n"], nproc=1, nnodes=2, init_process_group=True, show_ranks="all",
               env={"COURSE_TEST_MARKER": marker}, run_dir=tmp_path / "run",
               out=io.StringIO(), err=io.StringIO())
    assert r.ok, r.error
    recs = [_records(r.stdout[k])[0] for k in (0, 1)]
    assert [x["world"] for x in recs] == [2, 2] and [x["local"] for x in recs] == [0, 0]
    assert sorted(x["group_rank"] for x in recs) == ["0", "1"]  # two nodes
    assert {x["sum"] for x in recs} == {3.0}
    assert all(x["listen"] == ["127.0.0.1"] for x in recs)
    assert "--nnodes=2" in r.command and "--rdzv-backend=c10d" in r.command


MPI_CELL = textwrap.dedent('''
    import sys
    total = comm.allreduce(RANK + 1)
    print(RANK, WORLD_SIZE, total, sys.argv[1:])
    if "fail" in sys.argv and RANK == WORLD_SIZE - 1:
        raise RuntimeError("mpi boom")
    comm.Barrier()
''')


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 4])
def test_mpirun_ranks_and_allreduce(tmp_path, marker, n):
    script = tmp_path / "mpi_cell.py"
    script.write_text(MPI_CELL)
    r = mpirun(script, WEIRD_ARGS, n=n, env={"COURSE_TEST_MARKER": marker}, run_dir=tmp_path / "run",
               show_ranks="all", out=io.StringIO(), err=io.StringIO())
    assert r.ok, r.error
    expected = n * (n + 1) // 2  # what one process summing 1..n gets
    assert [r.stdout[k] for k in range(n)] == [f"{k} {n} {expected} {WEIRD_ARGS}\n" for k in range(n)]


@pytest.mark.timeout(90)
def test_mpirun_failure_aborts_the_job(tmp_path, marker):
    script = tmp_path / "mpi_cell.py"
    script.write_text(MPI_CELL)
    r = mpirun(script, ["fail"], n=3, env={"COURSE_TEST_MARKER": marker}, run_dir=tmp_path / "run",
               out=io.StringIO(), err=io.StringIO())
    assert not r.ok and r.failed_rank == 2
    assert "RuntimeError: mpi boom" in r.traceback and "mpi_cell.py:6" in r.error


@pytest.mark.timeout(90)
def test_wall_clock_limit_stops_a_hung_run(tmp_path, marker):
    """MPI has no collective timeout: the launcher's wall-clock limit ends the hang and says
    where each rank was (mpiexec starts in a second, so the limit can be short)."""
    script = tmp_path / "mpi_hang.py"
    script.write_text(textwrap.dedent('''
        import time
        print("started", flush=True)
        if RANK == 1:
            time.sleep(120)  # never reaches the barrier
        comm.Barrier()
    '''))
    r = mpirun(script, n=2, timeout=6, env={"COURSE_TEST_MARKER": marker},
               run_dir=tmp_path / "run", out=io.StringIO(), err=io.StringIO())
    assert r.timed_out and r.returncode == 124 and r.failure is None
    assert "timed out after 6 s" in r.error
    assert "rank 0 was still running at mpi_hang.py:6: comm.Barrier() (in Barrier)" in r.error
    assert "rank 1 was still running at mpi_hang.py:5: time.sleep(120)" in r.error
    assert r.stdout == {0: "started\n", 1: "started\n"}



@pytest.mark.timeout(90)
def test_mpirun_ranks_ignore_the_parents_rank_variables(tmp_path, marker, monkeypatch):
    """A caller that holds torchrun's RANK and WORLD_SIZE (itself a rank, or a notebook that set them
    for a one-process group): inherited, every MPI rank read RANK=0 before its PMI_RANK, the two
    wrote one rank's log files, one crashed and the other hung until the wall-clock limit."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    script = tmp_path / "ranks.py"
    script.write_text("import os\nprint(RANK, WORLD_SIZE, os.environ.get('RANK'), comm.allreduce(RANK + 1))\n")
    r = mpirun(script, n=2, timeout=20, env={"COURSE_TEST_MARKER": marker}, run_dir=tmp_path / "run",
               show_ranks="all", out=io.StringIO(), err=io.StringIO())
    assert r.ok, r.error
    assert [r.stdout[k] for k in (0, 1)] == ["0 2 None 3\n", "1 2 None 3\n"]


@pytest.mark.timeout(90)
def test_a_port_taken_after_it_was_picked_does_not_fail_a_launch(tmp_path, marker, monkeypatch):
    """A free port picked by the launcher and bound by the agent only once it has imported torch
    (seconds later) may be taken meanwhile; the one-node c10d rendezvous then failed ("The
    connection to the C10d store has failed"). The agent now binds a free port itself (port 0)."""
    import socket

    from course_lib.launch import torchrun

    with socket.socket() as taken:  # what another process did between the pick and the agent's bind
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(torchrun, "free_port", lambda host="127.0.0.1": taken.getsockname()[1])
        script = tmp_path / "hello.py"
        script.write_text("print('hello', RANK)\n")
        r = launch(script, nproc=2, device="cpu", init_process_group=True, env={"COURSE_TEST_MARKER": marker},
                   run_dir=tmp_path / "run", timeout=60, out=io.StringIO(), err=io.StringIO())
    assert r.ok, r.error
    assert r.stdout[0] == "hello 0\n"
