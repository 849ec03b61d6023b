"""The vocabulary split over the tensor-parallel group: embedding, LM head and cross-entropy.

GPT ties its token embedding wte (V, C) to the LM head. Megatron-LM (Shoeybi et al. 2019, Sec. 3)
splits that one matrix by vocabulary rows: rank ``tp_rank`` holds the rows of tokens
[tp_rank V/tp, (tp_rank+1) V/tp), for both of its uses:

* embedding: each rank looks up the tokens it owns and writes zeros for the others; the sum over
  the group (g: all-reduce, or a reduce-scatter along the sequence under sequence parallelism)
  is the full embedding.
* LM head: logits_i = x wte_i^T, (N, V/tp), a column-parallel linear. The logits are never
  gathered: (N, V) floats are the largest activation of a small-vocabulary-heavy model.
* cross-entropy on the split logits, with three all-reduces of N numbers each (Megatron's
  ``_VocabParallelCrossEntropy``): the max over the vocabulary (for stability), the sum of
  exp(logit - max), and the target's logit (held by one rank, zeros elsewhere):

      loss_n = log(sum_v exp(z_nv - m_n)) + m_n - z_{n, y_n}

  and the gradient on rank i's logits is softmax(z)_i - onehot(y)_i, computed locally.

A vocabulary that tp does not divide (Shakespeare's 65 characters on 2 ranks) is padded to the
next multiple of tp (Megatron's ``--make-vocab-size-divisible-by``). The padding rows are never
looked up and their logits are masked to -inf, so they get no gradient and the model computes
exactly what the unpadded one does; checkpoints keep the unpadded rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.parallel.comms import Comms
from course_lib.parallel.tensor.comms import reduce_from_tp, reduce_scatter_seq


def padded_vocab_size(vocab_size: int, tp_world_size: int) -> int:
    return -(-vocab_size // tp_world_size) * tp_world_size


def vocab_range(vocab_size: int, tp_rank: int, tp_world_size: int) -> tuple[int, int]:
    """Token ids [start, end) of rank ``tp_rank``'s rows of the padded vocabulary."""
    n = padded_vocab_size(vocab_size, tp_world_size) // tp_world_size
    return tp_rank * n, (tp_rank + 1) * n


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the (padded) token embedding, (V/tp, C); forward returns the full
    embedding, (B, T, C), or this rank's tokens of it, (B, T/tp, C), with ``sequence_parallel``."""

    def __init__(self, vocab_size: int, n_embd: int, comms: Comms, sequence_parallel: bool = False):
        super().__init__()
        self.comms, self.sequence_parallel = comms, sequence_parallel
        self.start, self.end = vocab_range(vocab_size, comms.rank, comms.world_size)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, n_embd))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)  # tokens another rank owns
        local = (idx - self.start).masked_fill(outside, 0)
        emb = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C) partial
        if self.sequence_parallel:
            return reduce_scatter_seq(emb, self.comms)
        return reduce_from_tp(emb, self.comms)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """logits (N, V/tp) on each rank, targets (N,) -> per-token loss (N,), equal on every rank."""

    @staticmethod
    def forward(ctx, logits, targets, start, comms):
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # softmax sums in fp32
        m = logits.max(dim=-1).values  # (N,) this rank's max
        comms.all_reduce(m, op=dist.ReduceOp.MAX)  # the max over the whole vocabulary
        z = logits - m.unsqueeze(-1)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        comms.all_reduce(sum_exp)  # (N,) the softmax denominator over the whole vocabulary
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < logits.shape[-1])
        idx = local_t.clamp(0, logits.shape[-1] - 1)
        target_z = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        comms.all_reduce(target_z)  # (N,) the target's (shifted) logit, from the rank holding it
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # (N, V/tp) this rank's part of the softmax
        ctx.save_for_backward(softmax, idx, mine)
        return sum_exp.log() - target_z

    @staticmethod
    def backward(ctx, grad):  # grad (N,)
        softmax, idx, mine = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))  # softmax - onehot
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 comms: Comms, ignore_index: int = -1, vocab_size: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of split logits (..., V/tp) against full-vocabulary targets (...),
    ``ignore_index`` targets excluded; every rank of the group returns the same value. Columns
    of ids >= ``vocab_size`` are padding: masked out."""
    if vocab_size is not None and vocab_start + logits.shape[-1] > vocab_size:
        ids = torch.arange(vocab_start, vocab_start + logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
    flat_t = targets.reshape(-1)
    keep = flat_t != ignore_index
    losses = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]),
                                              flat_t.masked_fill(~keep, 0), vocab_start, comms)
    return (losses * keep).sum() / keep.sum().clamp(min=1)
