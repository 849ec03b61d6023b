"""torchrun --nproc-per-node 2 -m course_lib.experiments.hang [--skip-rank 1] [--busy 60] [--fixed]

A deliberate hang: one rank skips a collective that the others call.

Every rank computes a local loss and all-reduces its gradients, except that the skipping rank
takes a shortcut (here: "my loss is already small, no need to synchronise") and goes on with other
work. A collective completes only when every rank of the group has called it, so the other ranks
wait in the all-reduce until the process group's timeout (``COURSE_COLLECTIVE_TIMEOUT`` seconds,
set by course_lib.launch; 10 s when run by plain torchrun) turns the silent hang into an error.
``--fixed`` makes the condition the same on every rank (decided on the all-reduced loss), which is
the cure: every branch that contains a collective must be taken by all ranks or by none.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from course_lib.utils import init_process_group


def skip_a_collective(skip_rank: int = 1, busy_s: float = 60.0, fixed: bool = False) -> dict:
    """Run one "step" on this rank; returns what it saw. Needs an initialised process group.

    skip_rank: the rank whose local condition makes it skip the all-reduce (-1: none).
    busy_s: how long the skipping rank then works on something else (it never joins).
    fixed: decide on the global (all-reduced) loss instead, so every rank takes the same branch.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    local_loss = torch.tensor([0.1 if rank == skip_rank else 2.0])  # rank skip_rank is "done"
    grads = torch.full((4,), float(rank + 1))
    if fixed:  # the cure: a condition every rank evaluates on the same (all-reduced) value
        dist.all_reduce(local_loss)
        local_loss /= world
    if local_loss.item() < 0.5:  # the bug, when not fixed: true on one rank only
        print(f"rank {rank}: loss {local_loss.item():.2f} is small, skipping the gradient all-reduce",
              flush=True)
        time.sleep(busy_s)  # other work; this rank never calls the all-reduce the others wait in
        return {"rank": rank, "synchronised": False}
    t0 = time.perf_counter()
    dist.all_reduce(grads)
    grads /= world
    return {"rank": rank, "synchronised": True, "grads": grads.tolist(),
            "waited_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.experiments.hang", description=__doc__.split("\n\n")[1])
    ap.add_argument("--skip-rank", type=int, default=1)
    ap.add_argument("--busy", type=float, default=60.0, help="seconds the skipping rank stays busy")
    ap.add_argument("--fixed", action="store_true", help="every rank takes the same branch")
    a = ap.parse_args(argv)
    if not dist.is_initialized():  # plain torchrun; course_lib.launch initialises the group itself
        timeout = float(os.environ.get("COURSE_COLLECTIVE_TIMEOUT", "10"))
        init_process_group("gloo", timeout_s=timeout)
    print(skip_a_collective(a.skip_rank, a.busy, a.fixed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
