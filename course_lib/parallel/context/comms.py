"""The communication of context parallelism: one hop of the ring, as an autograd function.

``ring_shift(x, comms)`` sends ``x`` to the next cp rank and returns the previous rank's (a
point-to-point isend / recv pair on the cp group); its backward sends the gradient the other way
round, so autograd differentiates ring attention (:mod:`course_lib.parallel.context.ring_attention`)
exactly.
"""

from __future__ import annotations

import torch

from course_lib.parallel.comms import Comms


class _RingShift(torch.autograd.Function):
    """Forward: send to the next rank, receive from the previous. Backward: the reverse."""

    @staticmethod
    def forward(ctx, x, comms):
        ctx.comms = comms
        return _shift(x, comms, +1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, ctx.comms, -1), None


def _shift(x: torch.Tensor, comms: Comms, step: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    work = comms.isend(x, (comms.rank + step) % comms.world_size)
    comms.recv(out, (comms.rank - step) % comms.world_size)
    comms.wait(work)
    return out


def ring_shift(x: torch.Tensor, comms: Comms) -> torch.Tensor:
    """(...) on cp rank r -> rank r - 1's tensor; gradients travel from r - 1 back to r."""
    return _RingShift.apply(x, comms)
