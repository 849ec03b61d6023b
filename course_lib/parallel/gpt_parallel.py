"""The course GPT cut for one place of the dp x pp x cp x tp grid: a pipeline stage of
tensor-, sequence- and context-parallel blocks.

:class:`GPTStage` holds this rank's part of :class:`course_lib.gpt.model.GPT`:

* pp: blocks ``split_layers(n_layer, pp)[pp_rank]``; the embeddings on the first stage, ``ln_f``
  and the LM head on the last (with pp > 1 the last stage keeps its own copy of the tied weight).
* tp (Megatron-LM, Shoeybi et al. 2019): attention heads and MLP columns split
  (:mod:`~course_lib.parallel.tensor.layers`), the tied wte / lm_head split by vocabulary and the
  loss computed on the split logits (:mod:`~course_lib.parallel.tensor.vocab`).
* sp (Korthikanti et al. 2022): the residual stream between the parallel linears is (B, T/tp, C)
  (:mod:`~course_lib.parallel.tensor.comms`); what passes between stages is that too.
* cp: this rank's two zigzag chunks of every sequence, (B, T/cp) tokens, attention by ring
  (:mod:`~course_lib.parallel.context.ring_attention`); position embeddings at the chunks' positions.
* ep (a mixture of experts, ``n_expert > 0``): each block's MLP is an
  :class:`~course_lib.parallel.expert.layer.ExpertParallelMoE` holding this rank's n_expert/ep
  experts (not split by tp); the shared expert is a tensor-parallel MLP.

Parameter names are the full model's (``transformer.h.3.attn.c_attn.weight``), so a full state
dict maps to a stage by name: :func:`shard_spec` says how each tensor is split over tp, and
:func:`shard_named` / :func:`unshard_named` go between the one full format and the shards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.parallel.comms import Comms
from course_lib.gpt.moe import aux_loss
from course_lib.parallel.context.ring_attention import cp_positions, ring_attention
from course_lib.parallel.expert.layer import ExpertParallelMoE, ep_shard
from course_lib.parallel.pipeline.schedules import split_layers
from course_lib.parallel.tensor.comms import copy_to_tp, gather_seq, seq_slice
from course_lib.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, divide
from course_lib.parallel.tensor.vocab import (
    VocabParallelEmbedding,
    padded_vocab_size,
    vocab_parallel_cross_entropy,
    vocab_range,
)


def is_vocab(name: str) -> bool:
    return name.endswith("wte.weight") or name == "lm_head.weight"


def shard_spec(name: str) -> tuple[int, int] | None:
    """How a full-model tensor is split over tp: (dim, fused) or None (replicated). ``fused``
    matrices stacked along ``dim`` (c_attn's Q, K, V) are split each."""
    if is_vocab(name):
        return 0, 1  # vocabulary rows (padded to a multiple of tp: shard_named)
    if ".attn.c_attn." in name:
        return 0, 3  # output columns of Q, K and V (nn.Linear stores (out, in))
    if ".mlp.c_fc." in name or ".mlp.shared.c_fc." in name:  # the MoE's shared expert too
        return 0, 1
    if name.endswith("c_proj.weight") and ".experts." not in name:
        return 1, 1  # row-parallel: input rows; its bias is replicated
    return None


def shard(full: torch.Tensor, spec, tp_rank: int, tp_world_size: int) -> torch.Tensor:
    """This tp rank's piece of a full tensor."""
    if spec is None or tp_world_size == 1:
        return full
    dim, fused = spec
    return torch.cat([part.chunk(tp_world_size, dim)[tp_rank] for part in full.chunk(fused, dim)], dim)


def unshard(pieces: list[torch.Tensor], spec) -> torch.Tensor:
    """The full tensor from every tp rank's piece (rank order); the inverse of :func:`shard`."""
    if spec is None or len(pieces) == 1:
        return pieces[0]
    dim, fused = spec
    parts = [p.chunk(fused, dim) for p in pieces]
    return torch.cat([torch.cat([p[f] for p in parts], dim) for f in range(fused)], dim)


def shard_named(name: str, full: torch.Tensor, tp_rank: int, tp_world_size: int, vocab_size: int) -> torch.Tensor:
    """This tp rank's piece of the full-model tensor ``name`` (vocabulary rows padded first)."""
    if is_vocab(name) and full.dim() and full.shape[0] == vocab_size:
        pad = padded_vocab_size(vocab_size, tp_world_size) - vocab_size
        full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])]) if pad else full
    return shard(full, shard_spec(name), tp_rank, tp_world_size)


def unshard_named(name: str, pieces: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    full = unshard(pieces, shard_spec(name))
    return full[:vocab_size] if is_vocab(name) and full.dim() else full


class ParallelAttention(nn.Module):
    def __init__(self, cfg, tp_comms: Comms, cp_comms: Comms, sequence_parallel: bool):
        super().__init__()
        C = cfg.n_embd
        self.n_head_local = divide(cfg.n_head, tp_comms.world_size, "n_head")
        self.cp_comms = cp_comms
        self.c_attn = ColumnParallelLinear(C, 3 * C, tp_comms, cfg.bias, fused=3, sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear(C, C, tp_comms, cfg.bias, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_attn(x)  # (B, T/cp, 3C/tp): sp gathers this rank's cp tokens first
        B, T = h.shape[:2]
        q, k, v = (t.view(B, T, self.n_head_local, -1).transpose(1, 2) for t in h.chunk(3, dim=2))
        y = ring_attention(q, k, v, self.cp_comms)  # (B, nh/tp, T/cp, hs)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T/cp [/tp with sp], C)


class ParallelMLP(nn.Module):
    def __init__(self, cfg, tp_comms: Comms, sequence_parallel: bool):
        super().__init__()
        C = cfg.n_embd
        self.c_fc = ColumnParallelLinear(C, 4 * C, tp_comms, cfg.bias, sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear(4 * C, C, tp_comms, cfg.bias, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class ParallelBlock(nn.Module):
    def __init__(self, cfg, tp_comms: Comms, cp_comms: Comms, sequence_parallel: bool,
                 ep_comms: dict[str, Comms] | None = None, ep_padded: bool = False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = ParallelAttention(cfg, tp_comms, cp_comms, sequence_parallel)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        if cfg.n_expert:  # experts over ep; the shared expert split by tp as the dense MLP
            ep_comms = ep_comms or {}
            self.mlp = ExpertParallelMoE(cfg, lambda c: ParallelMLP(c, tp_comms, sequence_parallel),
                                         ep_comms.get("ep"), ep_comms.get("router"),
                                         padded=ep_padded)
        else:
            self.mlp = ParallelMLP(cfg, tp_comms, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _Head(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight  # (V/tp, C)


class GPTStage(nn.Module):
    """This rank's part of the GPT; ``forward(idx or activation, targets)`` -> activation, or the
    loss on the last stage. ``comms``: dict with "tp", "sp" (the tp group, counted apart), "cp";
    with experts "ep" (the all-to-all) and "router" (the dp x cp counts). ``ep_padded``: the naive
    all-to-all (parallel.expert.comms)."""

    def __init__(self, cfg, pp_rank: int, pp_world_size: int, comms: dict[str, Comms],
                 sequence_parallel: bool = False, ep_padded: bool = False):
        super().__init__()
        if cfg.dropout:
            raise ValueError("the model-parallel GPT has no dropout (each tp group would need one "
                             "random stream for its replicated regions); use dropout=0")
        self.config, self.sequence_parallel = cfg, sequence_parallel
        self.tp_comms, self.sp_comms, self.cp_comms = comms["tp"], comms["sp"], comms["cp"]
        self.ep_comms = comms.get("ep")
        self.has_extra_loss = bool(cfg.n_expert)  # the load-balancing loss (pipeline.schedules)
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_world_size - 1
        sp_tp = self.sp_comms if sequence_parallel else self.tp_comms
        layers = split_layers(cfg.n_layer, pp_world_size)[pp_rank]
        parts = {"h": nn.ModuleDict({str(i): ParallelBlock(cfg, sp_tp, self.cp_comms, sequence_parallel, comms, ep_padded)
                                     for i in layers})}
        if self.is_first:
            parts["wte"] = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, sp_tp, sequence_parallel)
            parts["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)
        if self.is_last:
            parts["ln_f"] = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.transformer = nn.ModuleDict(parts)
        tied = None
        if self.is_last:
            if self.is_first:  # one stage: one tensor, two uses (as in GPT)
                self.lm_head = _Head(self.transformer.wte.weight)
            else:
                rows = padded_vocab_size(cfg.vocab_size, self.tp_comms.world_size) // self.tp_comms.world_size
                self.lm_head = _Head(nn.Parameter(torch.empty(rows, cfg.n_embd)))
                tied = self.lm_head.weight  # summed with the first stage's wte gradient
        elif self.is_first and pp_world_size > 1:
            tied = self.transformer.wte.weight
        object.__setattr__(self, "tied", tied)  # a reference, not a second registration
        self.frozen: frozenset[str] = frozenset()  # full-model names of frozen parameters (freeze)
        self.vocab_start = vocab_range(cfg.vocab_size, self.tp_comms.rank, self.tp_comms.world_size)[0]

    def local_tokens(self, n_local: int) -> int:
        """Tokens per sequence in this rank's residual stream (B, n, C)."""
        return n_local // self.tp_comms.world_size if self.sequence_parallel else n_local

    def activation_shape(self, idx: torch.Tensor) -> tuple[int, int, int]:
        return idx.shape[0], self.local_tokens(idx.shape[1]), self.config.n_embd

    def positions(self, n_local: int, device) -> torch.Tensor:
        """Positions of the tokens in this rank's residual stream."""
        cp = self.cp_comms.world_size
        pos = cp_positions(n_local * cp, self.cp_comms.rank, cp) if cp > 1 else torch.arange(n_local)
        if self.sequence_parallel:
            pos = pos[seq_slice(n_local, self.tp_comms.rank, self.tp_comms.world_size)]
        return pos.to(device)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        tr = self.transformer
        if self.is_first:  # x: token ids (B, T/cp)
            x = tr.wte(x) + tr.wpe(self.positions(x.shape[1], x.device))  # (B, T/cp [/tp], C)
        for block in tr.h.values():
            x = block(x)
        if not self.is_last:
            return x
        x = tr.ln_f(x)
        x = gather_seq(x, self.sp_comms) if self.sequence_parallel else copy_to_tp(x, self.tp_comms)
        logits = F.linear(x, self.lm_head.weight)  # (B, T/cp, V/tp): never the full vocabulary
        loss = vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.tp_comms,
                                            vocab_size=self.config.vocab_size)
        return loss + self.extra_loss() if self.training else loss

    def extra_loss(self) -> torch.Tensor | float:
        """The load-balancing loss of this stage's MoE blocks in its last forward, weighted
        (gpt/moe.py; 0.0 without experts): the last stage adds it to its loss, the pipeline adds
        the others' (pipeline.schedules)."""
        return self.config.aux_loss_coef * aux_loss(self) if self.config.n_expert else 0.0

    def sp_partial(self, name: str) -> bool:
        """Under sequence parallelism, parameters replicated over tp see only this rank's tokens:
        their gradients must be summed over the tp group."""
        return self.sequence_parallel and shard_spec(name) is None

    def freeze(self, names) -> None:
        """Freeze the parameters of these full-model names (the GPT's frozen ones: they stay frozen
        here; the last stage's copy of the tied weight follows ``transformer.wte.weight``)."""
        self.frozen = frozenset(names)
        for n, p in self.named_parameters():
            p.requires_grad_(("transformer.wte.weight" if n == "lm_head.weight" else n) not in self.frozen)

    @torch.no_grad()
    def load_full_state(self, full: dict[str, torch.Tensor]) -> None:
        """Take this rank's shards of a full GPT state dict (its tensors keep their places)."""
        tp, rank, v = self.tp_comms.world_size, self.tp_comms.rank, self.config.vocab_size
        ep_rank, ep = self.ep_place
        self.load_state_dict({k: ep_shard(k, shard_named(k, full[k], rank, tp, v), ep_rank, ep)
                              for k in self.state_dict()})

    @property
    def ep_place(self) -> tuple[int, int]:
        """(ep_rank, ep) of this rank's experts ((0, 1) without expert parallelism)."""
        c = self.ep_comms
        return (c.rank, c.world_size) if c is not None else (0, 1)
