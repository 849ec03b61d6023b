"""notebook_launcher: a function run on N processes with gloo, compared with one process."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from course_lib.launch import LaunchConfigError, notebook_launcher
from course_lib.launch.forked import NotebookLaunchError


def allreduce_and_gather(x):
    """Each rank holds x * (rank + 1); returns its all-reduced copy and the gathered pieces."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = x * (rank + 1)
    total = mine.clone()
    dist.all_reduce(total)
    pieces = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(pieces, mine)
    return {"rank": rank, "world": world, "env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
            "threads": torch.get_num_threads(), "total": total, "pieces": pieces}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nproc", [2, 3])
def test_collectives_match_one_process(nproc):
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    results = notebook_launcher(allreduce_and_gather, (x,), nproc=nproc)
    reference = [x * (r + 1) for r in range(nproc)]  # what one process computes
    expected_total = torch.stack(reference).sum(0)
    for rank, res in enumerate(results):
        assert res["rank"] == rank and res["world"] == nproc
        assert res["env"] == (str(rank), str(nproc))
        assert res["threads"] == max(1, len(os.sched_getaffinity(0)) // nproc)
        torch.testing.assert_close(res["total"], expected_total)
        for got, want in zip(res["pieces"], reference):
            torch.testing.assert_close(got, want)


def fails_on_rank_one():
    if dist.get_rank() == 1:
        raise KeyError("missing on rank 1")
    dist.barrier()


@pytest.mark.timeout(60)
def test_failure_names_the_rank_with_traceback():
    with pytest.raises(NotebookLaunchError, match="rank 1 failed: KeyError: 'missing on rank 1'") as e:
        notebook_launcher(fails_on_rank_one, nproc=2)
    assert e.value.rank == 1 and "in fails_on_rank_one" in e.value.traceback


@pytest.mark.timeout(60)
def test_time_limit_names_the_ranks_that_did_not_finish():  # a collective's timeout: tests/test_hang.py
    with pytest.raises(NotebookLaunchError, match=r"time limit of 2 s reached; ranks \[0, 1\] did not finish"):
        notebook_launcher(time.sleep, (30,), nproc=2, time_limit=2)


def test_bad_input_refused():
    with pytest.raises(LaunchConfigError, match="nproc must be"):
        notebook_launcher(print, nproc=0)
    with pytest.raises(LaunchConfigError, match="fn must be a function"):
        notebook_launcher("print", nproc=2)
    with pytest.raises(LaunchConfigError, match="backend='gloo'"):
        notebook_launcher(print, nproc=2, backend="nccl")
    for threads in (0, -1, 1.5):  # 0 was silently the default
        with pytest.raises(LaunchConfigError, match="threads must be"):
            notebook_launcher(print, nproc=2, threads=threads)


def _disabled_bar(*_rank_and_world_size):  # run_ranks passes them, notebook_launcher does not
    from tqdm.auto import tqdm

    with tqdm(total=1, disable=True) as bar:  # every bar takes tqdm's lock, a disabled one too
        bar.update(1)
    return dist.get_rank()


@pytest.mark.timeout(120)
def test_ranks_started_while_another_thread_holds_tqdms_lock_do_not_hang():
    """tqdm's monitor thread takes tqdm's lock every 10 s; a rank forked from the kernel in that
    moment kept the lock held forever and hung at its first progress bar (seen once in a full
    test run). Here a thread holds the lock all along: the ranks, which start from the fork
    server, not from this process, must still finish."""
    import threading

    from tqdm.auto import tqdm

    from course_lib.launch.spawn import run_ranks

    held, release = threading.Event(), threading.Event()

    def hold():
        with tqdm.get_lock():
            held.set()
            release.wait()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait()
    try:
        assert run_ranks(_disabled_bar, 2, timeout=30) == [0, 1]
        assert notebook_launcher(_disabled_bar, nproc=2, timeout=30) == [0, 1]
    finally:
        release.set()
        holder.join()
