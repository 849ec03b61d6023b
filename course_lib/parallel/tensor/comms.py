"""The communication of tensor and sequence parallelism: two pairs of conjugate operators, each
an autograd Function whose backward is its forward's transpose.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, Sec. 3, Figure 3):

    f (copy_to_tp):     forward identity,   backward all-reduce     (before a column-parallel layer)
    g (reduce_from_tp): forward all-reduce, backward identity       (after a row-parallel layer)

Sequence parallelism: the tensor-parallel group also splits the sequence (Korthikanti et al. 2022).
Under plain tensor parallelism the LayerNorms, dropouts and residual adds between the parallel
linears run on the full (B, T, C) activation on every rank: replicated work and replicated
activation memory. Sequence parallelism shards those regions along T: rank ``tp_rank`` keeps
tokens [tp_rank T/tp, (tp_rank+1) T/tp). The conjugate operators of Megatron's f and g become
(Korthikanti et al. 2022, Sec. 4.2.2, Figure 5):

    g     (enter a column-parallel linear): forward all-gather along T,     backward reduce-scatter
    g_bar (leave a row-parallel linear):    forward reduce-scatter along T, backward all-gather

(the paper's names: g replaces Megatron's f, g_bar its g; Figure 5's caption defines both).

An all-reduce is a reduce-scatter followed by an all-gather, so the bytes sent are the same as
tensor parallelism's; what is saved is activation memory (and the LayerNorm work) divided by tp.

Parameters used in the sharded regions (LayerNorm gains and biases, the row-parallel biases, the
position embedding) see only this rank's tokens: their gradients are partial sums over the tp
group, all-reduced after backward (Megatron's ``allreduce_sequence_parallel_grads``).
"""

from __future__ import annotations

import torch

from course_lib.parallel.comms import Comms


class _CopyToTP(torch.autograd.Function):
    """f: forward identity; backward all-reduce (each rank's input gradient is a partial sum)."""

    @staticmethod
    def forward(ctx, x, comms):
        ctx.comms = comms
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comms.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce (sum the partial products); backward identity."""

    @staticmethod
    def forward(ctx, x, comms):
        x = x.contiguous().clone()
        comms.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, comms: Comms) -> torch.Tensor:
    return _CopyToTP.apply(x, comms)


def reduce_from_tp(x: torch.Tensor, comms: Comms) -> torch.Tensor:
    return _ReduceFromTP.apply(x, comms)


def _gather_seq(x: torch.Tensor, comms: Comms) -> torch.Tensor:
    """(B, t, ...) on each rank -> (B, tp t, ...): the ranks' slices in rank order."""
    xt = x.transpose(0, 1).contiguous()  # (t, B, ...): collectives concatenate along dim 0
    out = xt.new_empty((comms.world_size * xt.shape[0], *xt.shape[1:]))
    comms.all_gather(out, xt)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, comms: Comms) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> (B, T/tp, ...): this rank's slice of the sum."""
    xt = x.transpose(0, 1).contiguous()  # (T, B, ...)
    out = xt.new_empty((xt.shape[0] // comms.world_size, *xt.shape[1:]))
    comms.reduce_scatter(out, xt)
    return out.transpose(0, 1).contiguous()


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comms):
        ctx.comms = comms
        return _gather_seq(x, comms)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.comms), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comms):
        ctx.comms = comms
        return _reduce_scatter_seq(x, comms)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.comms), None


def gather_seq(x: torch.Tensor, comms: Comms) -> torch.Tensor:
    """g: (B, T/tp, C) -> (B, T, C); its backward reduce-scatters the partial gradients."""
    return _GatherSeq.apply(x, comms)


def reduce_scatter_seq(x: torch.Tensor, comms: Comms) -> torch.Tensor:
    """g_bar: (B, T, C) partial sums -> (B, T/tp, C) summed; its backward all-gathers."""
    return _ReduceScatterSeq.apply(x, comms)


def seq_slice(length: int, tp_rank: int, tp_world_size: int) -> slice:
    """This rank's tokens of a length-``length`` local sequence."""
    if length % tp_world_size:
        raise ValueError(f"sequence parallelism splits the {length} tokens of a rank's sequence over "
                         f"tp_world_size={tp_world_size} ranks: it must divide them")
    n = length // tp_world_size
    return slice(tp_rank * n, (tp_rank + 1) * n)
