"""All-reduce as a PRAM program: the ring algorithm of data parallelism, with exclusive access only.

In data parallelism every rank r holds its own gradient ``G[r, :]`` (N numbers) and all of them
must end with the sum over ranks. On a CRCW-sum PRAM that is one step (``grad_accumulate``); real
ranks have no shared memory that adds, so NCCL and gloo build the sum from messages. The ring
algorithm (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 69(2), 2009) cuts each gradient into p chunks of m = N/p and runs

- a reduce-scatter: p - 1 steps; at step s rank r receives chunk (r - 1 - s) mod p from rank
  r - 1 and adds it to its own, so after p - 1 steps rank r holds the full sum of chunk
  (r + 1) mod p;
- an all-gather: p - 1 steps; at step s rank r receives the finished chunk (r - s) mod p from
  rank r - 1 and keeps it.

Here one PRAM processor stands for one element of a rank's chunk (N processors in all, m per
rank), and "receive from rank r - 1" is a read of row r - 1. No cell is read or written by two
processors in one step, so the program runs on EREW: 2(p - 1) steps, (p - 1) N additions and
(p - 1) N copies. Each rank sends m = N/p numbers per step, 2 (p - 1) N / p in all, the least any
all-reduce can send (Patarasuk & Yuan, Section 3). The PRAM counts the steps and not the bytes
on each link, which is why it cannot tell this ring from a tree: see notebook 6.
"""

from __future__ import annotations

import random

from .kernels import randn
from .program import Program, coords, phases

__all__ = ["ring_allreduce", "ring_allreduce_counts"]


def _check(p: int, N: int) -> None:
    for name, v in (("p", p), ("N", N)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"ring_allreduce: {name} must be a positive integer, got {v!r}")
    if p < 2:
        raise ValueError(f"ring_allreduce needs p >= 2 ranks, got p={p}")
    if N % p:
        raise ValueError(f"ring_allreduce cuts the N={N} gradient values into p={p} equal "
                         f"chunks: choose N divisible by p (e.g. N={p * max(1, N // p)})")


def ring_allreduce_counts(p: int, N: int) -> dict:
    """``{"steps", "work", "processors", "sent_per_rank"}`` of :func:`ring_allreduce`."""
    _check(p, N)
    return {"steps": 2 * (p - 1), "work": 2 * (p - 1) * N, "processors": N,
            "sent_per_rank": 2 * (p - 1) * (N // p)}


def ring_allreduce(p: int, N: int, seed: int = 0) -> Program:
    """Ring all-reduce (sum) of ``p`` ranks' gradients of ``N`` numbers each, in place in
    ``G[p, N]``: every row ends as the sum of all rows. EREW, N processors, 2(p - 1) steps."""
    _check(p, N)
    m = N // p                               # chunk length: processors per rank
    G = randn(random.Random(seed), p, N)

    def reduce_scatter(pid, s, mem):         # rank r adds rank r-1's partial chunk
        r, k = coords(pid, (p, m))
        i = ((r - 1 - s) % p) * m + k        # element k of chunk (r - 1 - s) mod p
        mem["G"][r, i] = mem["G"][r, i] + mem["G"][(r - 1) % p, i]
        mem.op("add")

    def all_gather(pid, s, mem):             # rank r copies rank r-1's finished chunk
        r, k = coords(pid, (p, m))
        i = ((r - s) % p) * m + k
        mem["G"][r, i] = mem["G"][(r - 1) % p, i]
        mem.op("copy")

    def expected():
        total = [sum(G.data[r * N + j] for r in range(p)) for j in range(N)]
        return {"G": [total] * p}

    step = phases((reduce_scatter, p - 1), (all_gather, p - 1))
    return Program("ring-allreduce", step, N, {"G": G}, step.steps, "EREW", expected,
                   f"every rank sends N/p = {m} numbers per step, 2(p-1)N/p = "
                   f"{2 * (p - 1) * m} in all", rtol=1e-12, atol=1e-12)
