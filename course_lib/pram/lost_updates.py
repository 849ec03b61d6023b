"""python -m course_lib.pram.lost_updates --workers 4 --updates 100000

What the CRCW combining rule protects against, on a real CPU. Several threads (or processes)
add 1 into one shared array cell by read-modify-write (``v = a[0]; a[0] = v + 1``) without
synchronisation: two workers that read the same ``v`` both write ``v + 1`` and one update is
lost. That is the CRCW-arbitrary rule, by accident. A combining write keeps every update:
``torch.index_add_`` / ``scatter_add_`` / ``np.add.at`` add all values aimed at one index, a
lock makes the read-modify-write atomic, and a reduction tree avoids concurrent writes.

Data parallelism has the same problem between ranks: each rank holds a gradient for the same
weights, and ``all_reduce(op=SUM)`` is the combining write that adds them all.

``lockstep=True`` forces the worst interleaving with a barrier between every read and write,
so the count of lost updates is exact ((workers - 1) * updates) and testable; free-running
workers lose a number that depends on scheduling, and is measured.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from course_lib.utils import check_count

from .trace import format_table

__all__ = ["UpdateCount", "racy_threads", "racy_processes", "locked_threads", "tree_threads",
           "combined_add", "fancy_index_add", "gradient_sync", "compare_methods"]


@dataclass(frozen=True)
class UpdateCount:
    """``expected`` updates were made by ``workers``; the shared cell ends at ``got``."""

    method: str
    workers: int
    expected: int
    got: int

    @property
    def lost(self) -> int:
        return self.expected - self.got

    def as_row(self) -> dict:
        return {"method": self.method, "workers": self.workers, "expected": self.expected,
                "got": self.got, "lost": self.lost}


def _check(workers: int, updates: int) -> None:
    check_count("workers", workers)
    check_count("updates", updates)


def _rmw_loop(cell: np.ndarray, updates: int, barrier, pause: bool) -> None:
    """The racy worker: read, (wait), write v + 1, ``updates`` times."""
    for _ in range(updates):
        v = int(cell[0])                     # read
        if barrier is not None:
            barrier.wait()                   # every worker has read the same v
        elif pause:
            time.sleep(0)                    # let another thread in between read and write
        cell[0] = v + 1                      # write: the other workers' updates are lost
        if barrier is not None:
            barrier.wait()                   # every worker has written before the next read


BARRIER_TIMEOUT_S = 60.0  # a worker that dies breaks the barrier instead of hanging the rest


def _run_threads(workers: int, target, *args) -> None:
    """Run ``target(w, *args)`` on ``workers`` threads; re-raise the first worker error."""
    errors: list[BaseException] = []

    def guarded(w):
        try:
            target(w, *args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {workers} worker threads failed") from errors[0]


def racy_threads(workers: int = 4, updates: int = 100_000, lockstep: bool = False,
                 pause: bool = False) -> UpdateCount:
    """Threads adding 1 to one numpy cell with unsynchronised read-modify-write.

    Under the GIL, an update is lost when the interpreter switches threads between a read
    and its write; ``pause`` forces a switch there every time (slow: use fewer updates).
    ``lockstep`` forces every worker's read before any worker's write, in every round.
    """
    _check(workers, updates)
    cell = np.zeros(1, dtype=np.int64)
    barrier = threading.Barrier(workers, timeout=BARRIER_TIMEOUT_S) if lockstep else None
    _run_threads(workers, lambda w: _rmw_loop(cell, updates, barrier, pause))
    name = "racy threads" + (" (lockstep)" if lockstep else "")
    return UpdateCount(name, workers, workers * updates, int(cell[0]))


def _process_worker(shm_name: str, updates: int, barrier, start) -> None:
    shm = shared_memory.SharedMemory(name=shm_name)
    try:
        start.wait()                           # all processes start the loop together
        _rmw_loop(np.ndarray((1,), dtype=np.int64, buffer=shm.buf), updates, barrier, False)
    finally:
        shm.close()


def racy_processes(workers: int = 2, updates: int = 100_000, lockstep: bool = False,
                   start_method: str = "spawn") -> UpdateCount:
    """Processes (truly parallel, one per core) adding 1 to one cell of shared memory."""
    _check(workers, updates)
    ctx = mp.get_context(start_method)
    shm = shared_memory.SharedMemory(create=True, size=8)
    try:
        cell = np.ndarray((1,), dtype=np.int64, buffer=shm.buf)
        cell[0] = 0
        barrier = ctx.Barrier(workers, timeout=BARRIER_TIMEOUT_S) if lockstep else None
        start = ctx.Barrier(workers, timeout=BARRIER_TIMEOUT_S)
        procs = [ctx.Process(target=_process_worker, args=(shm.name, updates, barrier, start))
                 for _ in range(workers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
        got = int(cell[0])
        del cell                               # release the buffer before closing
    finally:
        shm.close()
        shm.unlink()
    name = "racy processes" + (" (lockstep)" if lockstep else "")
    return UpdateCount(name, workers, workers * updates, got)


def locked_threads(workers: int = 4, updates: int = 10_000) -> UpdateCount:
    """The same read-modify-write made atomic with a lock: exact, but serialised."""
    _check(workers, updates)
    cell, lock = np.zeros(1, dtype=np.int64), threading.Lock()

    def work(w):
        for _ in range(updates):
            with lock:
                cell[0] = cell[0] + 1

    _run_threads(workers, work)
    return UpdateCount("lock", workers, workers * updates, int(cell[0]))


def tree_threads(workers: int = 4, updates: int = 10_000) -> UpdateCount:
    """Each thread adds into its own slot (exclusive writes), then a pairwise tree adds the
    slots in ceil(log2 workers) rounds: the EREW way, exact."""
    _check(workers, updates)
    slots = np.zeros(workers, dtype=np.int64)

    def work(w):
        for _ in range(updates):
            slots[w] = slots[w] + 1

    _run_threads(workers, work)
    stride = 1
    while stride < workers:                    # round: slot i += slot i + stride
        for i in range(0, workers - stride, 2 * stride):
            slots[i] += slots[i + stride]
        stride *= 2
    return UpdateCount("reduction tree", workers, workers * updates, int(slots[0]))


def combined_add(workers: int = 4, updates: int = 10_000, op: str = "index_add_") -> UpdateCount:
    """Threads record their updates as (index, value) pairs; one combining write
    (``torch.index_add_`` or ``scatter_add_``) adds all pairs aimed at one index: exact."""
    import torch  # here, not at the top: the spawned workers of racy_processes import this module
    _check(workers, updates)
    pieces: list = [None] * workers

    def work(w):                               # private buffers: no shared writes
        pieces[w] = torch.ones(updates, dtype=torch.int64)

    _run_threads(workers, work)
    values = torch.cat(pieces)
    index = torch.zeros_like(values)           # every update aims at cell 0
    cell = torch.zeros(1, dtype=torch.int64)
    if op == "index_add_":
        cell.index_add_(0, index, values)
    elif op == "scatter_add_":
        cell.scatter_add_(0, index, values)
    else:
        raise ValueError(f"op must be 'index_add_' or 'scatter_add_', got {op!r}")
    return UpdateCount(f"torch {op}", workers, workers * updates, int(cell[0]))


def fancy_index_add(index: list[int], size: int) -> dict:
    """One process, no threads: ``a[index] += 1`` with a repeated index keeps one update per
    index (numpy documents this), while ``np.add.at`` and ``index_add_`` keep them all."""
    import torch  # here, not at the top: the spawned workers of racy_processes import this module
    idx = np.asarray(index)
    plain = np.zeros(size, dtype=np.int64)
    plain[idx] += 1
    at = np.zeros(size, dtype=np.int64)
    np.add.at(at, idx, 1)
    t = torch.zeros(size, dtype=torch.int64).index_add_(0, torch.as_tensor(idx),
                                                         torch.ones(len(idx), dtype=torch.int64))
    return {"a[index] += 1": plain.tolist(), "np.add.at": at.tolist(),
            "index_add_": t.tolist(), "lost": len(index) - int(plain.sum())}


def gradient_sync(world_size: int = 4, n: int = 8, seed: int = 0) -> dict:
    """Ranks (threads) add their gradients into one shared buffer: racy read-modify-write in
    lockstep keeps one rank's gradient per element; ``index_add_`` gives the sum that
    ``all_reduce(op=SUM)`` computes. Returns the max error of each against the exact sum."""
    import torch  # here, not at the top: the spawned workers of racy_processes import this module
    check_count("world_size", world_size)
    check_count("n", n)
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, dtype=torch.float64, generator=g) for _ in range(world_size)]
    exact = torch.stack(grads).sum(0)
    shared = torch.zeros(n, dtype=torch.float64)
    barrier = threading.Barrier(world_size, timeout=BARRIER_TIMEOUT_S)

    def rank(r):
        v = shared.clone()                     # read
        barrier.wait()
        shared.copy_(v + grads[r])             # write: the other ranks' gradients are lost
    _run_threads(world_size, rank)
    combined = torch.zeros(n, dtype=torch.float64).index_add_(
        0, torch.arange(n).repeat(world_size), torch.cat(grads))
    return {"racy": float((shared - exact).abs().max()),
            "index_add_": float((combined - exact).abs().max())}


def compare_methods(workers: int = 4, updates: int = 100_000) -> list[dict]:
    """Every method side by side (racy, locked, tree, combined), as table rows."""
    runs = [racy_threads(workers, updates), racy_threads(workers, 200, lockstep=True),
            racy_processes(workers, updates), locked_threads(workers, updates),
            tree_threads(workers, updates), combined_add(workers, updates),
            combined_add(workers, updates, "scatter_add_")]
    return [r.as_row() for r in runs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.pram.lost_updates",
                                description=__doc__.split("\n\n")[1])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--updates", type=int, default=100_000)
    args = p.parse_args(argv)
    print(format_table(compare_methods(args.workers, args.updates)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
