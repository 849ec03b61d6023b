"""The communication of expert parallelism: tokens to the ranks holding their experts and back.

Each rank of the ep group holds E/ep experts (rank q: experts [q E/ep, (q+1) E/ep)). A MoE layer's
assignments on this rank, sorted by expert (M rows of C values), are cut into ep blocks, block j
for rank j's experts, and exchanged with one all-to-all (GShard, Lepikhin et al. 2020, Sec. 2.2
and 3.2: "dispatch" and "combine"; Fedus et al. 2021, "Switch Transformers", Sec. 2.2, Figure 3):

    counts   all-to-all of the (ep, E/ep) assignment counts: rank j learns how many rows of each
             of its experts it will receive from every rank (E/ep int64 to each peer)
    dispatch all-to-all of the rows: rank j receives, from each rank in turn, that rank's rows
             for j's experts
    combine  the same exchange reversed: each expert's outputs go back to the rank of their token

Both are autograd functions whose backward is the reverse exchange (the transpose of a
permutation): the gradients of the combined outputs travel to the experts and those of the
dispatched rows back to their tokens. A layer's forward and backward therefore send, per
micro-batch, 2 x (rows dispatched to other ranks + rows received from other ranks) x C values,
plus the counts.

Two versions behind one interface (``padded``):

* exact splits (``padded=False``, the optimised one): ``all_to_all_single`` with the real row count
  per peer, learned from the counts exchange; only real rows travel.
* padded equal splits (``padded=True``, the naive one, as GShard's fixed-capacity dispatch
  tensor): every block padded to ``pad_rows`` (the most one rank could send to one peer: all its
  assignments), so the all-to-all has equal splits and needs no size agreement; the zeros travel
  too: each rank sends (ep - 1) x pad_rows x C values per exchange.
"""

from __future__ import annotations

import torch

from course_lib.parallel.comms import Comms


class _AllToAll(torch.autograd.Function):
    """rows (sum(input_splits), ...) -> (sum(output_splits), ...); backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x, comms: Comms, output_splits: list[int], input_splits: list[int]):
        ctx.comms, ctx.splits = comms, (output_splits, input_splits)
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        comms.all_to_all(out, x.contiguous(), output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        gx = grad.new_empty(sum(input_splits), *grad.shape[1:])
        ctx.comms.all_to_all(gx, grad.contiguous(), input_splits, output_splits)
        return gx, None, None, None


def all_to_all(x: torch.Tensor, comms: Comms, input_splits: list[int], output_splits: list[int]) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` (``input_splits[j]`` rows to rank j)."""
    if comms.world_size == 1:
        return x
    return _AllToAll.apply(x, comms, list(output_splits), list(input_splits))


def exchange_counts(send_counts: torch.Tensor, comms: Comms) -> torch.Tensor:
    """send_counts (ep, E/ep): rows this rank sends to each rank's experts -> (ep, E/ep): the rows
    each rank sends to this rank's experts (row j from rank j)."""
    recv = torch.empty_like(send_counts)
    comms.all_to_all(recv, send_counts.contiguous())
    return recv


def _pad_index(counts: list[int], pad_rows: int, device) -> torch.Tensor:
    """Where the rows of blocks of ``counts`` rows go in a buffer of len(counts) x pad_rows rows."""
    return torch.cat([j * pad_rows + torch.arange(n, device=device) for j, n in enumerate(counts)])


def dispatch(x: torch.Tensor, send_counts: torch.Tensor, comms: Comms, padded: bool = False,
             pad_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, C): this rank's assignments sorted by expert, send_counts (ep, E/ep) rows per expert ->
    (rows for this rank's experts, grouped by source rank then expert; recv_counts (ep, E/ep))."""
    recv_counts = exchange_counts(send_counts, comms)
    send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    if not padded:
        return all_to_all(x, comms, send, recv), recv_counts
    ep = comms.world_size
    buf = x.new_zeros(ep * pad_rows, *x.shape[1:]).index_copy(0, _pad_index(send, pad_rows, x.device), x)
    out = all_to_all(buf, comms, [pad_rows] * ep, [pad_rows] * ep)
    return out[_pad_index(recv, pad_rows, x.device)], recv_counts


def combine(y: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor, comms: Comms,
            padded: bool = False, pad_rows: int = 0) -> torch.Tensor:
    """The reverse of :func:`dispatch`: y (rows of this rank's experts, as dispatch returned them)
    -> (M, C) in the order of the ``x`` that was dispatched."""
    send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    if not padded:
        return all_to_all(y, comms, recv, send)
    ep = comms.world_size
    buf = y.new_zeros(ep * pad_rows, *y.shape[1:]).index_copy(0, _pad_index(recv, pad_rows, y.device), y)
    out = all_to_all(buf, comms, [pad_rows] * ep, [pad_rows] * ep)
    return out[_pad_index(send, pad_rows, y.device)]
