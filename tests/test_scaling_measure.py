"""The measured scaling workload: even split, deterministic work, strong and weak scaling rows
consistent with the laws of :mod:`course_lib.analysis.scaling_laws`, the figure and the command."""

import threading
import time

import pytest

from course_lib.analysis.scaling_laws import karp_flatt
from course_lib.experiments import scaling_measure as sm
from course_lib.notebook.plots import plot_scaling


def test_work_is_split_evenly():
    assert sm._split(10, 3) == [4, 3, 3] and sum(sm._split(7, 7)) == 7


def test_a_unit_of_work_is_cpu_work_not_a_sleep():
    n = 2 * sm.UNIT_ITERS
    t0 = time.process_time()
    assert sm.burn(2) == (n - 1) * n * (2 * n - 1) // 6 % 1_000_003  # the sum of i^2 for i < n, closed form
    assert time.process_time() > t0  # this process's CPU time advanced: work, not a wait


@pytest.mark.timeout(120)
def test_measurements_are_consistent():
    strong = sm.measure_strong([2, 1], serial_units=1, parallel_units=4, repeats=1)
    assert [r["p"] for r in strong] == [1, 2]
    assert strong[0]["speedup"] == 1.0 and strong[0]["karp_flatt"] is None
    r = strong[1]
    assert r["efficiency"] == pytest.approx(r["speedup"] / 2)
    assert r["karp_flatt"] == pytest.approx(karp_flatt(r["speedup"], 2))
    weak = sm.measure_weak([1, 2], serial_units=1, parallel_units_per_proc=2, repeats=1)
    assert weak[0]["scaled_speedup"] == 1.0
    for w in weak:
        assert 0 < w["serial_share"] <= 1
        assert w["gustafson"] == pytest.approx(w["serial_share"] + (1 - w["serial_share"]) * w["p"])
        assert w["scaled_speedup"] == pytest.approx(w["seconds_1"] / w["seconds"])
    fig = plot_scaling(strong, 0.05, weak, s_written=1 / 5, p_max=64)
    assert len(fig.axes) == 2 and len(fig.axes[1].get_lines()) == 5  # ideal, 2 x Amdahl, Gustafson, measured
    with pytest.raises(ValueError, match="between 0 and 1"):
        plot_scaling(strong, 1.5)
    with pytest.raises(ValueError, match="procs"):
        sm.measure_strong([0, 1])


@pytest.mark.timeout(120)
def test_the_measurements_show_their_progress(capsys):
    """A bar per process count: on a 64-core hub node weak scaling takes minutes."""
    sm.measure_strong([2, 4], serial_units=1, parallel_units=4, repeats=1)  # + the 1-process baseline
    sm.measure_weak([1, 2], serial_units=1, parallel_units_per_proc=2, repeats=1)
    err = capsys.readouterr().err
    assert "strong scaling: 100%" in err and "3/3" in err and "weak scaling: 100%" in err and "2/2" in err
    sm.measure_weak([1], serial_units=1, parallel_units_per_proc=2, repeats=1, progress=False)
    assert "scaling" not in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_command_line(capsys):
    assert sm.main(["--procs", "1,2", "--serial-units", "1", "--parallel-units", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "serial part written in: s = 0.333" in out and "Karp-Flatt e =" in out and "fitted Amdahl" in out
    with pytest.raises(SystemExit):
        sm.main(["--procs", "one,two"])
    assert "--procs takes whole numbers" in capsys.readouterr().err


HELD = threading.Lock()  # stands for a lock that one of a notebook kernel's threads holds


def _held_lock_is_free() -> bool:
    free = HELD.acquire(timeout=1)
    if free:
        HELD.release()
    return free


def test_the_workers_do_not_inherit_a_lock_that_a_thread_holds():
    """A kernel always runs threads (heartbeat, output). A fork copies a lock one of them holds into
    each worker, locked for good (Python 3.12+ warns of it); the pool's workers start clean."""
    HELD.acquire()
    try:
        pool = sm._pool(2)
        try:
            assert pool.apply(_held_lock_is_free) is True
        finally:
            pool.terminate()
            pool.join()
    finally:
        HELD.release()
