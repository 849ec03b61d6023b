"""Lost updates on a real CPU, and the combining writes that prevent them.

The racy counts are asserted only under a forced interleaving (a barrier between every read
and every write), where exactly (workers - 1) * updates are lost; free-running counts depend
on scheduling, so for them only the bookkeeping is checked.
"""

import pytest

from course_lib.pram import lost_updates as lu


def test_lockstep_threads_lose_exactly_workers_minus_one_updates_per_round():
    r = lu.racy_threads(workers=4, updates=50, lockstep=True)
    assert (r.expected, r.got, r.lost) == (200, 50, 150)
    assert r.as_row() == {"method": "racy threads (lockstep)", "workers": 4, "expected": 200,
                          "got": 50, "lost": 150}


@pytest.mark.timeout(60)
def test_lockstep_processes_on_shared_memory_lose_updates_too():
    r = lu.racy_processes(workers=2, updates=20, lockstep=True)
    assert (r.expected, r.got, r.lost) == (40, 20, 20)


@pytest.mark.timeout(60)
def test_free_running_racy_counts_are_reported_consistently():
    for r in (lu.racy_threads(workers=3, updates=20_000),
              lu.racy_threads(workers=2, updates=200, pause=True),
              lu.racy_processes(workers=2, updates=5_000)):
        assert r.expected == r.workers * (r.expected // r.workers)
        assert 1 <= r.got <= r.expected and r.lost == r.expected - r.got


@pytest.mark.parametrize("method", [
    lambda: lu.locked_threads(workers=4, updates=5_000),
    lambda: lu.tree_threads(workers=5, updates=5_000),
    lambda: lu.combined_add(workers=4, updates=5_000),
    lambda: lu.combined_add(workers=4, updates=5_000, op="scatter_add_"),
])
def test_combining_writes_lose_nothing(method):
    r = method()
    assert r.got == r.expected == r.workers * 5_000 and r.lost == 0


def test_vectorised_add_with_a_repeated_index_keeps_one_update_per_index():
    # numpy: "a[indices] += 1 ... only incremented once" for repeated indices (ufunc.at docs)
    out = lu.fancy_index_add([0, 0, 0, 1, 3, 3], size=4)
    assert out["a[index] += 1"] == [1, 1, 0, 1]
    assert out["np.add.at"] == out["index_add_"] == [3, 1, 0, 2]
    assert out["lost"] == 3


def test_gradient_sync_racy_loses_gradients_while_the_sum_is_exact():
    err = lu.gradient_sync(world_size=4, n=8)
    assert err["racy"] > 0.1
    assert err["index_add_"] < 1e-12


def test_bad_arguments():
    with pytest.raises(ValueError, match="workers must be a whole number >= 1, got 0"):
        lu.racy_threads(workers=0)
    with pytest.raises(ValueError, match="updates must be a whole number >= 1, got 2.5"):
        lu.locked_threads(updates=2.5)
    with pytest.raises(ValueError, match="world_size must be a whole number >= 1, got 0"):
        lu.gradient_sync(0)
    with pytest.raises(ValueError, match="op must be 'index_add_' or 'scatter_add_'"):
        lu.combined_add(2, 10, op="add_")


@pytest.mark.timeout(60)
def test_main_prints_the_table(capsys):
    assert lu.main(["--workers", "2", "--updates", "2000"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["method", "workers", "expected", "got", "lost"]
    rows = {line[:23].strip(): line.split()[-3:] for line in lines[2:]}
    assert rows["lock"] == ["4,000", "4,000", "0"]
    assert rows["racy threads (lockstep)"] == ["400", "200", "200"]


def test_a_failing_worker_is_reported_not_swallowed():
    def boom(w):
        if w == 1:
            raise KeyError("worker 1")

    with pytest.raises(RuntimeError, match="1 of 3 worker threads failed"):
        lu._run_threads(3, boom)
