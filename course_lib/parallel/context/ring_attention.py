"""Context parallelism: the sequence split over cp ranks, attention by ring (Liu et al. 2023).

Everything in a transformer but attention treats tokens independently, so with the sequence
split over ``cp_world_size`` ranks only attention communicates: each rank keeps its queries and
passes its keys and values around a ring, cp - 1 hops, computing attention against each K/V
block as it arrives (Ring Attention, Liu, Zaharia and Abbeel 2023). The blocks' results merge
exactly with the online-softmax rule (Milakov and Gimelshein 2018; FlashAttention, Dao et al.
2022): with o_b = softmax(s_b) v_b and lse_b = logsumexp(s_b) per block,

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b

Causal load balance: with the sequence cut into cp contiguous pieces the last rank's queries see
every key and the first rank's almost none. Cutting it into 2 cp chunks instead, rank i holds
chunks i and 2 cp - 1 - i (an early and a late one), so every rank does the same work (the
"zigzag" layout of Megatron-LM's context parallelism; Brandon et al. 2023, "Striped Attention",
balance it another way, spreading each rank's tokens evenly over the sequence). A (query chunk a,
key chunk b) pair is full for b < a, causal for b = a, and skipped for b > a.

Backward: the ring shift is an autograd function whose backward sends the gradient the other way
round, so autograd differentiates the ring exactly. It keeps every K/V block of the forward
(cp times the local K/V); the paper's implementation instead recomputes and sends dK/dV blocks
around the ring in backward, which keeps memory constant. The ring's send/recv is in
:mod:`course_lib.parallel.context.comms`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from course_lib.parallel.comms import Comms
from course_lib.parallel.context.comms import ring_shift


def zigzag_chunks(cp_rank: int, cp_world_size: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) of every sequence that rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp_world_size - 1 - cp_rank


def cp_positions(seq_len: int, cp_rank: int, cp_world_size: int) -> torch.Tensor:
    """Positions (T/cp,) of the tokens this rank holds, in the order it holds them."""
    if seq_len % (2 * cp_world_size):
        raise ValueError(f"context parallelism cuts the block of {seq_len} tokens into 2 x cp = "
                         f"{2 * cp_world_size} chunks: block_size must be divisible by 2*cp")
    c = seq_len // (2 * cp_world_size)
    return torch.cat([torch.arange(k * c, (k + 1) * c) for k in zigzag_chunks(cp_rank, cp_world_size)])


def cp_split(t: torch.Tensor, cp_rank: int, cp_world_size: int) -> torch.Tensor:
    """(B, T, ...) full sequences -> (B, T/cp, ...) this rank's two chunks."""
    if cp_world_size == 1:
        return t
    return t[:, cp_positions(t.shape[1], cp_rank, cp_world_size).to(t.device)]


def _block_attention(q, k, v, causal: bool):
    """q (B, nh, c, hs), k, v (B, nh, c', hs) -> o (B, nh, c, hs), lse (B, nh, c, 1)."""
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.exp(s - lse) @ v, lse


def _merge(acc, o_b, lse_b):
    if acc is None:
        return o_b, lse_b
    o_a, lse_a = acc
    lse = torch.logaddexp(lse_a, lse_b)
    return o_a * torch.exp(lse_a - lse) + o_b * torch.exp(lse_b - lse), lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comms: Comms) -> torch.Tensor:
    """Exact causal attention of this rank's queries over the whole sequence.

    q, k, v: (B, nh, T/cp, hs), the rank's two zigzag chunks concatenated. Returns (B, nh, T/cp, hs).
    """
    cp, rank = comms.world_size, comms.rank
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    qs = q.chunk(2, dim=2)  # the rank's two query chunks
    q_ids = zigzag_chunks(rank, cp)
    acc = [None, None]
    kv = torch.stack([k, v])  # (2, B, nh, T/cp, hs): one message per hop
    for hop in range(cp):
        src = (rank - hop) % cp  # whose K/V this rank holds now
        k_ids = zigzag_chunks(src, cp)
        ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
        for i, a in enumerate(q_ids):
            for j, b in enumerate(k_ids):
                if b <= a:  # b > a: keys after every query of the chunk (fully masked)
                    o_b, lse_b = _block_attention(qs[i], ks[j], vs[j], causal=b == a)
                    acc[i] = _merge(acc[i], o_b, lse_b)
        if hop < cp - 1:
            kv = ring_shift(kv, comms)
    return torch.cat([acc[0][0], acc[1][0]], dim=2).to(q.dtype)
