"""The communication of pipeline parallelism: point-to-point messages between neighbouring stages.

Forward sends a stage's output activation to the next stage, backward the gradient of its input
to the previous one; every message carries the logical-clock tick at which it was produced (the
schedule's own timing, :mod:`course_lib.parallel.pipeline.schedules`). After backward the first
and last stages swap their gradients of the tied weight (GPT's wte / lm_head) and both add them,
as Megatron-LM does with its embedding group.
"""

from __future__ import annotations

import torch

from course_lib.parallel.comms import Comms


def send_activation(comms: Comms, t: torch.Tensor, tick: float, dst: int) -> list:
    """Start sending ``t`` and its tick to stage ``dst``; the two pending works (wait on them)."""
    return [comms.isend(t.contiguous(), dst),
            comms.isend(torch.tensor([tick], dtype=torch.float64, device=t.device), dst)]


def recv_activation(comms: Comms, shape, dtype: torch.dtype, device, src: int) -> tuple[torch.Tensor, float]:
    """The tensor of ``shape`` stage ``src`` sends (activation or gradient) and its tick."""
    t = torch.empty(shape, dtype=dtype, device=device)
    tick = torch.zeros(1, dtype=torch.float64, device=device)
    comms.recv(t, src)
    comms.recv(tick, src)
    return t, tick.item()


def exchange_tied_grad(comms: Comms, mine: torch.Tensor, other: int) -> torch.Tensor:
    """Send this stage's gradient of the tied weight to stage ``other`` and return ``other``'s."""
    theirs = torch.empty_like(mine)
    work = comms.isend(mine.contiguous(), other)
    comms.recv(theirs, other)
    comms.wait(work)
    return theirs
