"""Seeded bugs for the debugging lesson (notebook 12) and its exercise: a data-parallel step written
by hand, with the bugs students write, to be found by :func:`course_lib.parallel.replicas.check_replicas`.

    %%ranks
    model, opt = replica(seed=0)                      # every rank builds the same model
    x = batch(RANK, shard=True)                       # each rank its own data
    step(model, opt, x, bug="sum")                    # the gradients summed, not averaged
    %ranks check_replicas model --optimizer opt --batch x --local mine

Each function runs on every rank of a process group. ``step`` keeps this rank's local gradients
(before the sync) in ``model.local_grads``, for the ``local`` argument of ``check_replicas``.
"""

from __future__ import annotations

import torch
import torch._dynamo  # AdamW's first step imports it (1 to 2 s, more on a busy machine): here, in
import torch.distributed as dist  # the lesson's import cell, not inside the first timed step
from torch import nn

from course_lib.parallel.replicas import local_grads

# The bugs ``step`` can seed; "" is the correct step.
BUGS = {
    "": "the correct data-parallel step: the gradients averaged over the ranks",
    # with SGD a world_size times larger step; AdamW divides by the gradient's running RMS, so its
    # step hardly changes: the bug waits for what reads the gradient's size (clipping, loss scale)
    "sum": "the gradients summed over the ranks, not averaged (world_size times the mean)",
    "skip_bias": "the last layer's bias is missing from the gradient sync (each rank keeps its own)",
}


def replica(seed: int = 0, lr: float = 0.05) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small MLP and its AdamW: the same on every rank only if every rank gives the same seed."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def batch(rank: int, shard: bool = True, step: int = 0, size: int = 16) -> torch.Tensor:
    """Rank ``rank``'s inputs at ``step``: its own shard of the data, or (``shard=False``, the bug)
    the same batch as every other rank."""
    g = torch.Generator().manual_seed(1000 * step + (rank if shard else 0))
    return torch.randn(size, 8, generator=g)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, bug: str = "") -> float:
    """One data-parallel step on a regression to sum(x); ``bug`` seeds one of :data:`BUGS`."""
    if bug not in BUGS:
        raise ValueError(f"bug must be one of {sorted(BUGS)}, got {bug!r}")
    optimizer.zero_grad()
    loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
    loss.backward()
    model.local_grads = local_grads(model)  # before the sync: what check_replicas compares with
    world = dist.get_world_size()
    last_bias = list(model.named_parameters())[-1][0]
    for name, p in model.named_parameters():
        if bug == "skip_bias" and name == last_bias:
            continue
        dist.all_reduce(p.grad)
        if bug != "sum":
            p.grad /= world
    optimizer.step()
    return loss.item()
