"""%ranks / %%ranks through a real Jupyter kernel, as a student uses them: a pool of 2 gloo ranks
that lives across cells, its values against a one-process reference, a rank's exception, an
interrupt, ``%ranks stop`` and a killed kernel, with the process table checked after each (and the
pool's folder after the kill). One kernel serves the tests of this file, in file order; the last
one kills it. Deadlocks (the cell limit, each rank's state, the pool usable after) are
tests/test_debugging.py's.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
import torch
from kernel_cells import Cell, run, start_kernel

from course_lib.hardware import gpu_count
from course_lib.launch.placement import LaunchConfigError, plan_ranks
from course_lib.launch.rank_pool import RankPool

LIMIT = 4  # the pool's cell limit and collective timeout in these tests, seconds


def test_the_pool_decides_where_ranks_run_before_anything_starts():
    """The same decision as course train (course_lib.launch.placement, tested in test_placement.py),
    made and refused in the constructor: no process is started by a bad request."""
    shared = RankPool(2, gpus=1)  # Colab's one T4: both ranks on it, over gloo
    assert (shared.placement.backend, shared.placement.devices) == ("gloo", ("cuda:0", "cuda:0"))
    assert shared.placement.line() == "plan: 2 ranks · cuda:0, cuda:0 (ranks share a GPU) · gloo · recipe %ranks"
    assert RankPool(4, gpus=0).placement.devices == ("cpu",) * 4 and not shared.running
    with pytest.raises(ValueError, match="NCCL allows one rank per GPU"):
        RankPool(2, backend="nccl", gpus=1)
    for bad in (0, 2.5, True, "4"):
        with pytest.raises(LaunchConfigError, match="whole number"):
            RankPool(bad, gpus=0)
    with pytest.raises(LaunchConfigError, match="timeout must be a number of seconds > 0"):
        RankPool(2, timeout=0, gpus=0)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    km, kc = start_kernel(tmp_path_factory.mktemp("kernel"))
    run(kc, "%load_ext course_lib")
    yield km, kc
    kc.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=True)


def _children(km) -> list[psutil.Process]:
    return psutil.Process(km.provisioner.process.pid).children(recursive=True)


def _gone(procs: list[psutil.Process], within: float = 15.0) -> list[int]:
    _, alive = psutil.wait_procs(procs, timeout=within)
    return [p.pid for p in alive]


@pytest.mark.timeout(180)
def test_pool_keeps_each_ranks_values_across_cells(kernel):
    _, kc = kernel
    start = run(kc, f"%ranks start 2 --timeout {LIMIT}")
    assert start.error is None, start.error
    plan = plan_ranks(gpu_count(), 2, recipe="%ranks").line()  # the devices this machine gives 2 ranks
    assert f"{plan} · cell limit {LIMIT} s · started" in start.stdout
    cell = run(kc, "%%ranks\nx = torch.arange(4.0) * (RANK + 1)\nprint('x', RANK, x.tolist())")
    assert cell.error is None, cell.error
    assert "rank 0 · done" in cell.display_text and "x 1 [0.0, 2.0, 4.0, 6.0]" in cell.display_text
    # the next cell sees x: the ranks are the same processes, and all-reduce sums their values
    run(kc, "%%ranks\ny = x.clone()\ndist.all_reduce(y)")
    pulled = run(kc, "import torch; ys = ranks.pull('y'); xs = ranks.pull('x'); print(torch.stack(ys).tolist())")
    reference = (torch.arange(4.0) * 1 + torch.arange(4.0) * 2).tolist()  # one process does the sum
    assert pulled.stdout.strip() == str([reference, reference])
    run(kc, "ranks.push_each(z=[torch.tensor(10.0), torch.tensor(20.0)]); ranks.push(w=1.5)")
    some = run(kc, "%%ranks 1\nprint('only', RANK, float(z + w))")
    assert "only 1 21.5" in some.display_text and "rank 0" not in some.display_text


@pytest.mark.timeout(120)
def test_an_exception_shows_that_ranks_traceback_and_leaves_the_others(kernel):
    _, kc = kernel
    cell = run(kc, "%%ranks\nif RANK == 1:\n    x = x / 0 + undefined_name\nprint('fine', RANK)")
    assert cell.error is not None and cell.error["ename"] == "RankPoolError"
    assert "rank 1: NameError: name 'undefined_name' is not defined" in cell.error["evalue"]
    assert "ranks [0] finished and are usable" in cell.error["evalue"]
    assert "rank 1 · error" in cell.display_text and "----> 2     x = x / 0 + undefined_name" in cell.display_text
    after = run(kc, "%%ranks\ndist.all_reduce(y)\nprint('sum', y.tolist())")
    assert after.error is None and after.display_text.count("sum [0.0, 6.0, 12.0, 18.0]") == 2


@pytest.mark.timeout(120)
def test_interrupting_the_kernel_interrupts_the_ranks(kernel):
    km, kc = kernel
    cell = Cell(kc, "%%ranks\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)")
    cell.pump(until=lambda c: c.display_text.count("sleeping") == 2)
    t0 = time.monotonic()
    km.interrupt_kernel()
    cell.pump(timeout=30)
    assert cell.error is not None and cell.error["ename"] == "KeyboardInterrupt"
    assert "interrupted rank(s) [0, 1]" in cell.error["evalue"] and time.monotonic() - t0 < 20
    assert run(kc, "%%ranks\nprint('awake', RANK)").display_text.count("awake") == 2


@pytest.mark.timeout(180)
def test_stop_and_a_killed_kernel_leave_no_process(kernel):
    km, kc = kernel
    procs = _children(km)
    assert len(procs) >= 3  # the controller and two engines, at least
    assert run(kc, "%ranks stop").stdout.strip() == "ranks stopped"
    assert _gone(procs) == []
    assert run(kc, f"%ranks start 2 --timeout {LIMIT}").error is None
    procs = _children(km)
    assert len(procs) >= 3
    folder = Path(run(kc, "print(ranks._dir)").stdout.strip())  # the pool's logs, exit statuses and store
    assert folder.is_dir()
    psutil.Process(km.provisioner.process.pid).kill()  # a crash, or a restart of a busy kernel: no atexit
    assert _gone(procs) == []
    assert not folder.exists()  # removed by the controller before it exits
