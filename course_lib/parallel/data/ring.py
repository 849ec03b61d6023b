"""The ring all-reduce written with point-to-point messages, one step at a time.

    from course_lib.parallel.data.ring import ring_all_reduce, ring_chunks, ring_step
    ring_all_reduce(t)                          # t becomes the sum over the ranks, in place
    chunks = ring_chunks(t, world_size)         # or step by step (lesson 02, %%ranks cells):
    ring_step(chunks, "reduce-scatter", 0)      # ... p - 1 steps, then p - 1 "all-gather" steps

The tensor is cut into p chunks. In the reduce-scatter phase, at step s, rank r sends chunk
(r - s) mod p to its right-hand neighbour and adds the chunk (r - s - 1) mod p that its left-hand
neighbour sends; after p - 1 steps rank r holds the full sum of chunk (r + 1) mod p. In the
all-gather phase each completed chunk travels once around the ring. Each rank sends
2(p - 1) chunks of n/p values: 2(p - 1)/p of the tensor, whatever p is (Patarasuk and Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", J. Parallel Distrib.
Comput. 69(2), 2009; the cost model is :func:`course_lib.analysis.comm_cost.collective_time`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

RING_PHASES = ("reduce-scatter", "all-gather")


def ring_chunks(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """``world_size`` views of ``tensor`` (contiguous) that together cover it."""
    if not tensor.is_contiguous() or tensor.numel() < world_size:
        raise ValueError(f"the ring needs a contiguous tensor of at least {world_size} values "
                         f"(one per rank), got {tuple(tensor.shape)}")
    return list(torch.tensor_split(tensor.view(-1), world_size))


def chunk_indices(phase: str, step: int, rank: int, world_size: int) -> tuple[int, int]:
    """(the chunk rank ``rank`` sends, the chunk it receives) at ``step`` of ``phase``."""
    if phase not in RING_PHASES:
        raise ValueError(f"phase must be one of {RING_PHASES}, got {phase!r}")
    if not 0 <= step < world_size - 1:
        raise ValueError(f"step must be from 0 to {world_size - 2} on {world_size} ranks, got {step}")
    shift = 0 if phase == "reduce-scatter" else 1
    return (rank - step + shift) % world_size, (rank - step - 1 + shift) % world_size


def ring_step(chunks: list[torch.Tensor], phase: str, step: int, group=None) -> tuple[int, int]:
    """One step of the ring on this rank: send a chunk right, receive one from the left, then add it
    (reduce-scatter) or copy it (all-gather). Returns (sent, received) chunk indices."""
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    send, recv = chunk_indices(phase, step, rank, p)
    right = dist.get_global_rank(group, (rank + 1) % p) if group is not None else (rank + 1) % p
    left = dist.get_global_rank(group, (rank - 1) % p) if group is not None else (rank - 1) % p
    incoming = torch.empty_like(chunks[recv])
    request = dist.isend(chunks[send].contiguous(), right, group=group)  # posted first: no rank waits on a send
    dist.recv(incoming, left, group=group)
    request.wait()
    if phase == "reduce-scatter":
        chunks[recv] += incoming
    else:
        chunks[recv].copy_(incoming)
    return send, recv


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group``, in place, with 2(p - 1) ring steps."""
    p = dist.get_world_size(group)
    if p == 1:
        return tensor
    chunks = ring_chunks(tensor, p)
    for phase in RING_PHASES:
        for step in range(p - 1):
            ring_step(chunks, phase, step, group)
    return tensor
