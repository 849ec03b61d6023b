"""Tensor parallelism: one layer's matrices split across ranks (Megatron-LM, Shoeybi et al. 2019).

The course's example: a matrix product y = x W with x split into column blocks and W into the
matching row blocks is a sum of smaller products, one per rank, joined by an all-reduce:

    y = x0 W0 + x1 W1 + x2 W2            (3 ranks; rank i holds W_i)

Megatron's MLP uses two splits (Sec. 3, Figure 3). The first matrix A is split by columns
(:class:`ColumnParallelLinear`): every rank computes GELU(x A_i) on its own, no communication.
The second matrix B is split by rows (:class:`RowParallelLinear`), so the partial products
GELU(x A_i) B_i are summed by one all-reduce. Two conjugate operators carry the communication:

    f: forward identity,   backward all-reduce     (before the column-parallel layer)
    g: forward all-reduce, backward identity       (after the row-parallel layer)

so a transformer block costs two all-reduces in forward and two in backward. Attention splits the
same way by heads: Q, K, V column-parallel (each rank owns n_head / tp heads), the output
projection row-parallel. LayerNorms, embeddings and biases after g are replicated; their
gradients are equal on every rank because g and f make the tensors they see equal.

f and g (and sequence parallelism's pair) live apart, in :mod:`course_lib.parallel.tensor.comms`;
this module holds the layers that use them.

Vocabulary: ``tp_rank``, ``tp_world_size``; the communication goes through a
:class:`~course_lib.parallel.comms.Comms` on the tensor-parallel group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.parallel.comms import Comms
from course_lib.parallel.tensor.comms import copy_to_tp, gather_seq, reduce_from_tp, reduce_scatter_seq


def divide(n: int, tp_world_size: int, what: str) -> int:
    if n % tp_world_size:
        raise ValueError(f"{what} ({n}) must be divisible by the tensor-parallel size "
                         f"tp_world_size ({tp_world_size}); choose a tp that divides it")
    return n // tp_world_size


def split_matmul_example(x: torch.Tensor, W: torch.Tensor, comms: Comms) -> torch.Tensor:
    """y = x W as sum_i x_i W_i: rank i multiplies its column block of x (B, d/tp) by its row block
    of W (d/tp, out); the all-reduce adds the tp partial products. Returns y (B, out) on every rank."""
    d = divide(W.shape[0], comms.world_size, "the inner dimension d of x W")
    rows = slice(comms.rank * d, (comms.rank + 1) * d)
    partial = x[:, rows] @ W[rows]  # this rank's term x_i W_i
    comms.all_reduce(partial)
    return partial


class ColumnParallelLinear(nn.Module):
    """y = x A with A (in, out) split by columns: this rank computes y_i = x A_i, (..., out/tp).

    ``fused`` > 1 is for a weight that stacks several matrices along its output (c_attn stacks
    Q, K and V): each of them is split, so a rank gets matching columns of all of them.
    ``sequence_parallel``: x arrives split along the sequence, (B, T/tp, in), and is all-gathered
    (Korthikanti's g) instead of passing f (:mod:`course_lib.parallel.tensor.comms`).
    """

    def __init__(self, in_features: int, out_features: int, comms: Comms, bias: bool = True,
                 fused: int = 1, dtype=None, device=None, sequence_parallel: bool = False):
        super().__init__()
        self.comms, self.fused, self.sequence_parallel = comms, fused, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        per_matrix = divide(out_features, fused, "out_features / fused") if fused > 1 else out_features
        local = divide(per_matrix, comms.world_size, "out_features of a column-parallel linear") * fused
        kw = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.randn(local, in_features, **kw) * 0.02)  # nn.Linear's (out, in)
        self.bias = nn.Parameter(torch.zeros(local, **kw)) if bias else None

    def shard_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full (out, ...) tensor, per fused matrix."""
        per = t.shape[0] // self.fused // self.comms.world_size
        parts = t.view(self.fused, -1, *t.shape[1:])[:, self.comms.rank * per:(self.comms.rank + 1) * per]
        return parts.reshape(-1, *t.shape[1:])

    @classmethod
    def from_linear(cls, linear: nn.Linear, comms: Comms, fused: int = 1) -> ColumnParallelLinear:
        m = cls(linear.in_features, linear.out_features, comms, linear.bias is not None, fused,
                dtype=linear.weight.dtype, device=linear.weight.device)
        with torch.no_grad():
            m.weight.copy_(m.shard_rows(linear.weight))
            if m.bias is not None:
                m.bias.copy_(m.shard_rows(linear.bias))
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_seq(x, self.comms) if self.sequence_parallel else copy_to_tp(x, self.comms)
        return F.linear(x, self.weight, self.bias)  # (..., out/tp)


class RowParallelLinear(nn.Module):
    """y = x B with B (in, out) split by rows: x arrives split, (..., in/tp) from a column-parallel
    layer; the partial products x_i B_i are summed by g; the bias is added once, after the sum.
    ``sequence_parallel``: g_bar reduce-scatters along the sequence, the output is (B, T/tp, out)."""

    def __init__(self, in_features: int, out_features: int, comms: Comms, bias: bool = True,
                 dtype=None, device=None, sequence_parallel: bool = False):
        super().__init__()
        self.comms, self.sequence_parallel = comms, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local = divide(in_features, comms.world_size, "in_features of a row-parallel linear")
        kw = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.randn(out_features, local, **kw) * 0.02)
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, comms: Comms) -> RowParallelLinear:
        m = cls(linear.in_features, linear.out_features, comms, linear.bias is not None,
                dtype=linear.weight.dtype, device=linear.weight.device)
        local = m.weight.shape[1]
        with torch.no_grad():
            m.weight.copy_(linear.weight[:, comms.rank * local:(comms.rank + 1) * local])
            if m.bias is not None:
                m.bias.copy_(linear.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # partial sums x_i B_i
        if self.sequence_parallel:
            y = reduce_scatter_seq(y, self.comms)  # (B, T/tp, out): this rank's tokens, summed
        else:
            y = reduce_from_tp(y, self.comms)  # (..., out), equal on all ranks
        return y + self.bias if self.bias is not None else y


class TensorParallelMLP(nn.Module):
    """GPT's MLP: column-parallel c_fc (C -> 4C/tp), GELU, row-parallel c_proj (4C/tp -> C)."""

    def __init__(self, c_fc: nn.Linear, c_proj: nn.Linear, comms: Comms, dropout: float = 0.0):
        super().__init__()
        self.c_fc = ColumnParallelLinear.from_linear(c_fc, comms)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = RowParallelLinear.from_linear(c_proj, comms)
        self.dropout = nn.Dropout(dropout)  # after g: every rank must draw the same mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class TensorParallelAttention(nn.Module):
    """Causal self-attention with the heads split: rank i owns heads [i nh/tp, (i+1) nh/tp)."""

    def __init__(self, attn: nn.Module, comms: Comms):
        super().__init__()
        self.n_head_local = divide(attn.n_head, comms.world_size, "n_head")
        self.c_attn = ColumnParallelLinear.from_linear(attn.c_attn, comms, fused=3)  # Q, K, V
        self.c_proj = RowParallelLinear.from_linear(attn.c_proj, comms)
        self.dropout = attn.dropout
        self.resid_dropout = nn.Dropout(attn.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # 3 x (B, T, C/tp)
        hs = q.shape[2] // self.n_head_local
        q, k, v = (t.view(B, T, self.n_head_local, hs).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, self.n_head_local * hs)  # (B, T, C/tp)
        return self.resid_dropout(self.c_proj(y))


def tensor_parallel_gpt(model: nn.Module, comms: Comms) -> nn.Module:
    """Turn a course_lib.gpt.model.GPT (identical on every rank) into its tensor-parallel version in
    place: every block's attention and MLP split across the ranks of ``comms``; embeddings (tied
    with the LM head), LayerNorms and the head replicated."""
    cfg = model.config
    divide(cfg.n_head, comms.world_size, "n_head")
    divide(4 * cfg.n_embd, comms.world_size, "the MLP width 4 * n_embd")
    for block in model.transformer.h:
        block.attn = TensorParallelAttention(block.attn, comms)
        block.mlp = TensorParallelMLP(block.mlp.c_fc, block.mlp.c_proj, comms, cfg.dropout)
    return model
