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

from course_lib.launch.rank_pool import RankHangError, RankPool, RankPoolError
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


@pytest.mark.timeout(10)
def test_terminal_view_prints_a_line_written_in_two_parts_as_one_line():
    """``print('step 1...', end='')`` then ``print(' done')`` later: the terminal view once printed
    the unfinished part as a line of its own, "[rank 0] step 1..." then "[rank 0]  done". A line is
    now printed when it ends, or when the cell does."""
    out = io.StringIO()
    board = RankBoard([0], out=out)
    for stdout in ("step 1...", "step 1... done\nstep 2...", "step 1... done\nstep 2..."):
        board.update([{"stdout": stdout, "stderr": "", "completed": None}])
    assert _lines(out.getvalue(), 0) == ["step 1... done"]
    board.update([{"stdout": "step 1... done\nstep 2...", "stderr": "", "completed": "now"}], final=True)
    assert _lines(out.getvalue(), 0) == ["step 1... done", "step 2..."]


@pytest.mark.timeout(10)
def test_terminal_view_prints_an_unfinished_line_of_a_rank_that_completed_before_the_last_update():
    out = io.StringIO()
    board = RankBoard([0], out=out)
    md = [{"stdout": "no newline", "stderr": "", "completed": "now"}]
    board.update(md)
    board.update(md, final=True)  # the same metadata as before: only the cell's end tells the line is complete
    assert _lines(out.getvalue(), 0) == ["no newline"]


# the collective timeout of the default group and of teaching mode's side group, where a checked
# collective waits first (the pool makes it also with teaching mode off)
_COLLECTIVE_TIMEOUT = ("from course_lib.parallel.collective_check import _STATE\n"
                       "print(*(g._get_backend(torch.device('cpu')).options._timeout.total_seconds()\n"
                       "        for g in (dist.distributed_c10d._get_default_group(), _STATE.side)))")


@pytest.mark.timeout(30)
def test_a_cells_timeout_is_its_collectives_timeout(pool, capsys):
    """``%%ranks --timeout 12`` on a pool started with ``--timeout 5``: the cell may run 12 s, but its
    collectives once still timed out at the pool's 5 + 2 s, so an all_reduce waiting 8 s for a rank
    that computes failed. The next cell without --timeout has the pool's again."""
    pool.run(_COLLECTIVE_TIMEOUT, timeout=12)
    pool.run(_COLLECTIVE_TIMEOUT)
    out = capsys.readouterr().out
    for r in (0, 1):
        assert _lines(out, r) == ["14.0 14.0", "7.0 7.0"], out


@pytest.mark.timeout(30)
def test_the_lost_variables_message_names_pushed_variables_and_those_of_a_stopped_cell(pool, capsys):
    """The list of a rank's variables was only taken after a cell that finished: a restarted rank's
    message left out what push and push_each had defined, and what a cell stopped at its time
    limit had defined before it was stopped."""
    pool.push(pushed_w=1)
    pool.push_each(pushed_each_v=[0, 1])
    with pytest.raises(RankHangError):
        pool.run("before_stop_y = RANK\nimport time\ntime.sleep(30)", timeout=0.5, show=False)
    capsys.readouterr()
    os.kill(pool._pids[1], signal.SIGKILL)
    psutil.wait_procs([psutil.Process(pool._parent_pids[1])], timeout=10)  # its parent records the exit
    pool.pull("RANK")
    out = capsys.readouterr().out
    lost = next((line for line in out.splitlines() if line.startswith(("rank 1 LOST", "rank 1 had"))), out)
    for name in ("pushed_w (pushed)", "pushed_each_v (pushed)", "before_stop_y (#"):
        assert name in lost, lost
