"""Collectives that count what they move and time how long the caller waits for them.

The parallel layers (data_parallel, zero, tensor_parallel, ...) call these helpers instead of
``torch.distributed`` directly, so every implementation reports the same two figures:

* ``volume_bytes``: the data volume of each collective per rank, with the ZeRO paper's
  accounting (Rajbhandari et al. 2020, Sec. 7.1): an all-reduce of a buffer of S bytes moves 2S
  (it is a reduce-scatter followed by an all-gather), a reduce-scatter S (the full input), an
  all-gather S (the full output), a broadcast S. The paper drops the ring algorithm's factor
  (N-1)/N; ``sent_bytes`` keeps it: what each rank sends with bandwidth-optimal algorithms
  (:func:`course_lib.analysis.comm_cost.bytes_per_rank`, the nccl-tests bus-bandwidth factors).
* ``seconds``: wall time spent inside blocking calls and ``wait()`` (exposed communication).
  An asynchronous collective overlapped with computation costs only its launch and whatever is
  left to wait for.

On CUDA (NCCL) a collective only enqueues work on a stream and returns at once, so a host timer
alone would read ~0. There the timed region first lets the compute already queued finish (not
counted: it is computation), then waits for the collective itself with a device synchronise.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from course_lib.analysis.comm_cost import bytes_per_rank

# torch 2.13 renamed the "_tensor" collectives to "_single"; keep older releases working.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# volume per rank as a multiple of the buffer size, in the ZeRO paper's accounting
VOLUME_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1,
                 "send": 1, "recv": 0, "all_to_all": 1}


class Comms:
    """Byte-counting, timed collectives on one process group (``group=None``: the world)."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.reset()

    def reset(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.volume: dict[str, int] = defaultdict(int)  # bytes, paper accounting, per op
        self.sent: dict[str, float] = defaultdict(float)  # bytes this rank sends, per op
        self.seconds = 0.0

    # --- what was moved ------------------------------------------------------------------------

    @property
    def volume_bytes(self) -> int:
        return sum(self.volume.values())

    @property
    def sent_bytes(self) -> float:
        return sum(self.sent.values())

    def _count(self, op: str, buffer_bytes: int, sent: float | None = None) -> None:
        self.calls[op] += 1
        self.volume[op] += VOLUME_FACTOR[op] * buffer_bytes
        if sent is not None:  # counted by the caller (all-to-all: what leaves this rank)
            self.sent[op] += sent
        elif op in ("send", "recv"):
            self.sent[op] += buffer_bytes if op == "send" else 0
        elif self.world_size > 1:
            self.sent[op] += bytes_per_rank(op, buffer_bytes, self.world_size)

    @contextlib.contextmanager
    def timed(self, cuda: bool = False, blocking: bool = True):
        """Time the block. ``cuda`` and ``blocking``: wait until the device is done with it."""
        settle = cuda and blocking
        if settle:
            torch.cuda.current_stream().synchronize()  # queued compute is not communication
        t0 = time.perf_counter()
        try:
            yield
            if settle:
                torch.cuda.synchronize()
        finally:
            self.seconds += time.perf_counter() - t0

    # --- collectives ---------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        """In place: every rank ends with the reduction of all ranks' ``tensor``."""
        self._count("all_reduce", _nbytes(tensor))
        with self.timed(tensor.is_cuda, not async_op):
            return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """input (N * n,) on every rank -> output (n,): rank r gets the sum of the r-th chunks."""
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                             f"world_size ({self.world_size}) x output ({output.numel()})")
        self._count("reduce_scatter", _nbytes(input))
        with self.timed(input.is_cuda, not async_op):
            return _reduce_scatter(output, input, group=self.group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """input (n,) on every rank -> output (N * n,): the ranks' inputs in rank order."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                             f"world_size ({self.world_size}) x input ({input.numel()})")
        self._count("all_gather", _nbytes(output))
        with self.timed(output.is_cuda, not async_op):
            return _all_gather(output, input, group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """``src`` is a rank in this group; every rank ends with its ``tensor``."""
        self._count("broadcast", _nbytes(tensor))
        with self.timed(tensor.is_cuda, not async_op):
            return dist.broadcast(tensor, src=self._global(src), group=self.group,
                                  async_op=async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None = None,
                   input_splits: list[int] | None = None) -> None:
        """Rank r sends rows ``input_splits[j]`` of ``input`` (dim 0, in order) to rank j and
        receives ``output_splits[j]`` rows from rank j into ``output``; None = equal splits.
        Counted: volume = the input (every row this rank holds for someone), sent = the rows that
        leave this rank (its own split stays)."""
        row = _nbytes(input) // max(input.shape[0], 1) if input.dim() else 0
        own = input_splits[self.rank] if input_splits is not None else input.shape[0] // self.world_size
        self._count("all_to_all", _nbytes(input), sent=(input.shape[0] - own) * row)
        with self.timed(input.is_cuda):
            dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Point-to-point to group rank ``dst`` (pipeline parallel)."""
        self._count("send", _nbytes(tensor))
        with self.timed(tensor.is_cuda):
            dist.send(tensor, dst=self._global(dst), group=self.group)

    def isend(self, tensor: torch.Tensor, dst: int):
        """Non-blocking send; keep ``tensor`` unchanged until the returned work is waited for."""
        self._count("send", _nbytes(tensor))
        with self.timed():
            return dist.isend(tensor, dst=self._global(dst), group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._count("recv", _nbytes(tensor))
        with self.timed(tensor.is_cuda):
            dist.recv(tensor, src=self._global(src), group=self.group)

    def wait(self, work) -> None:
        """Block until an asynchronous collective finished; the wait counts as exposed time."""
        if work is not None:
            with self.timed(torch.cuda.is_available() and torch.cuda.is_initialized()):
                work.wait()

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def ep_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is one rank's own expert weights under expert parallelism (flagged by
    :class:`course_lib.parallel.expert.layer.ExpertParallelMoE`, as Megatron-LM marks its expert
    parameters): the data-parallel strategies leave such tensors alone, and the expert-parallel
    layer averages them over their own group."""
    return getattr(t, "ep_sharded", False)


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, comms: Comms, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (initial-state sync)."""
    for t in list(module.parameters()) + list(module.buffers()):
        if not ep_sharded(t):  # each rank's own experts (parallel.expert)
            comms.broadcast(t.data, src=src)
