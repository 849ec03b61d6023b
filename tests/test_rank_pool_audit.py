"""RankPool driven from plain Python, as a script or a terminal IPython drives it: what the
terminal view prints of a cell, values pushed to a rank that died between cells, and a start on
a pool that runs already. One pool of 2 gloo ranks serves the tests of this file (it takes a few
seconds to start on 2 cores); tests/test_rank_pool.py has the notebook's view through a kernel.
"""

from __future__ import annotations

import io
import os
import signal
import time

import psutil
import pytest

from course_lib.launch.rank_pool import RankPool, RankPoolError
from course_lib.launch.rank_pool_view import RankBoard


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, gpus=0, timeout=5, check=False).start(log=lambda _line: None)
    yield p
    p.stop()


def _lines(text: str, rank: int) -> list[str]:
    return [line.removeprefix(f"[rank {rank}] ") for line in text.splitlines() if line.startswith(f"[rank {rank}] ")]


@pytest.mark.timeout(10)
def test_terminal_view_prints_each_line_once_when_stderr_comes_between_stdout():
    """The terminal view once cut each update at the length it had printed of stdout+stderr
    together: a line of stderr between two of stdout was printed twice, and the stdout after it
    never. The updates below are what ipyparallel's metadata of one rank hold as the cell runs."""
    out = io.StringIO()
    board = RankBoard([0], out=out)
    for stdout, stderr in (("a\n", ""), ("a\n", "E\n"), ("a\nb\n", "E\n")):
        board.update([{"stdout": stdout, "stderr": stderr, "completed": None}])
    board.update([{"stdout": "a\nb\n", "stderr": "E\n", "completed": "now"}], final=True)
    assert sorted(_lines(out.getvalue(), 0)) == ["E", "a", "b"]


@pytest.mark.timeout(60)
def test_a_cell_that_writes_stderr_between_stdout_shows_every_line(pool, capsys):
    pool.run("import sys, time\nprint('a', flush=True)\ntime.sleep(0.5)\n"
             "print('E', file=sys.stderr, flush=True)\ntime.sleep(0.5)\nprint('b', flush=True)")
    out = capsys.readouterr().out
    for r in (0, 1):
        assert sorted(_lines(out, r)) == ["E", "a", "b"], out


@pytest.mark.timeout(60)
def test_push_each_starts_a_rank_that_died_between_cells_again(pool, capsys):
    """As pull and push do (the module's docstring): push_each once failed with ipyparallel's
    "IndexError: No such engine: 1" after rank 0 had got its value."""
    pool.run("x = RANK", show=False)
    os.kill(pool._pids[1], signal.SIGKILL)
    psutil.wait_procs([psutil.Process(pool._parent_pids[1])], timeout=10)  # its parent records the exit
    pool.push_each(z=[10, 20])
    assert "rank 1 DIED since the last cell (signal SIGKILL)" in capsys.readouterr().out
    assert pool.pull("z") == [10, 20]


@pytest.mark.timeout(10)
def test_push_each_on_a_pool_not_started_says_so():
    with pytest.raises(RankPoolError, match="the pool is not running"):
        RankPool(2, gpus=0).push_each(z=[1, 2])  # once: TypeError: 'NoneType' object is not subscriptable


@pytest.mark.timeout(60)
def test_start_on_a_running_pool_is_refused_and_starts_nothing(pool):
    """A second start once started a second cluster over the first, whose processes and folder
    nothing stopped any more (stop() knew only the new one's) until the kernel ended."""
    folder, pids = pool._dir, list(pool._pids)
    with pytest.raises(RankPoolError, match="running already"):
        pool.start()
    time.sleep(0.5)
    # every process of ours belongs to this pool (a spare engine may still be starting beside it)
    assert {_pool_dir(p) for p in psutil.Process().children(recursive=True)} <= {str(folder), None}
    assert (pool._dir, pool._pids) == (folder, pids) and folder.is_dir()
    assert pool.pull("RANK") == [0, 1]


def _pool_dir(p: psutil.Process) -> str | None:
    try:
        return p.environ().get("COURSE_RANKS_DIR")
    except psutil.Error:  # gone meanwhile
        return None


@pytest.mark.timeout(30)
def test_the_magic_refuses_options_an_action_would_ignore_and_ranks_not_in_the_pool(pool, capsys):
    """``%ranks restart --timeout 60`` kept the old limit without a word; ``%%ranks 5`` on 2 ranks
    came out as a LaunchConfigError traceback, after restarting any dead rank."""
    from IPython.core.error import UsageError

    from course_lib.launch.magics import RankPoolMagics

    magics = RankPoolMagics(shell=None)
    magics.pool = pool
    for line in ("restart --timeout 60", "stop --backend gloo", "status --no-check", "flight --device cpu"):
        with pytest.raises(UsageError, match=f"%ranks {line.split()[0]} takes no --"):
            magics.ranks(line)
    assert pool.running
    with pytest.raises(UsageError, match=r"%%ranks: ranks must be between 0 and 1, got \[5\]"):
        magics.ranks("5", "print('never')")
    with pytest.raises(UsageError, match="timeout"):
        magics.ranks("0 --timeout 0", "print('never')")
    magics.ranks("1", "print('rank one here')")
    assert "[rank 1] rank one here" in capsys.readouterr().out
