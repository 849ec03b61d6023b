"""Expert parallelism of the course GPT's mixture of experts (:mod:`course_lib.gpt.moe`).

:class:`ExpertParallelMoE` is the MoE layer of one rank of the grid
(:class:`~course_lib.parallel.process_groups.ProcessGroupGrid`, ``ep`` carved out of dp):

* it holds experts [ep_rank E/ep, (ep_rank+1) E/ep) of every MoE block (the ``.experts.`` tensors'
  first dimension: :func:`ep_shard` / :func:`ep_unshard` go between them and the one full state
  dict); the router and the shared expert are replicated like every other parameter;
* ``run_experts``: the assignments go to the ranks of their experts and back by all-to-all
  (:mod:`course_lib.parallel.expert.comms`, exact or padded splits);
* ``token_counts``: one all-gather of the (k, E) assignment counts over the data-parallel group
  (dp x cp: every rank holding other tokens of the micro-batch), so that the load-balancing loss's
  f and the capacity are those of the global micro-batch (layout-independent, gpt/moe.py; the
  two layouts where it would not be are refused: ``registry.moe_grid_error``).

Gradients (:func:`sync_expert_grads`). Every rank's loss is the mean over its own tokens, and the
step's loss the mean over the dp x cp ranks. An expert's gradient on its rank sums what the tokens
of the whole ep group sent it; summing that over the replicas of the shard (the edp x cp group,
dp/ep x cp ranks) gives the sum over every rank's tokens, which is divided by dp x cp (not by the
group's size). The other parameters are averaged over all dp x cp ranks by the data-parallel
strategy, which skips the experts (they are flagged ``ep_sharded``). As Megatron-LM's
expert-data-parallel group and DeepSeek-V3's (Sec. 3.2) layout: experts data-parallel over dp/ep.

Tensor parallelism: the experts are not split by tp; each tp rank runs its ep shard on the full
tokens (as the LayerNorms), so the ep group and the all-to-all are per tp rank.
"""

from __future__ import annotations

import torch

from course_lib.gpt.moe import MoE
from course_lib.parallel.comms import Comms, ep_sharded
from course_lib.parallel.expert.comms import combine, dispatch


def is_expert(name: str) -> bool:
    """Is the full-model tensor ``name`` one of the stacked experts (sharded over ep)?"""
    return ".mlp.experts." in name


def ep_shard(name: str, full: torch.Tensor, ep_rank: int, ep: int) -> torch.Tensor:
    """This ep rank's experts of the full tensor ``name`` (rows of its first dimension)."""
    if ep == 1 or not is_expert(name) or not full.dim():
        return full
    return full.chunk(ep, 0)[ep_rank]


def ep_unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every ep rank's piece (rank order); the inverse of :func:`ep_shard`."""
    return torch.cat(pieces) if len(pieces) > 1 and is_expert(name) and pieces[0].dim() else pieces[0]


class ExpertParallelMoE(MoE):
    """The MoE layer of one rank: its E/ep experts, dispatch and combine by all-to-all over
    ``ep_comms`` (None: ep = 1), the router's counts over ``dp_comms`` (the dp x cp group; None:
    this rank alone).
    ``padded``: the naive all-to-all with equal, padded splits (expert.comms)."""

    def __init__(self, cfg, mlp_factory, ep_comms: Comms | None, dp_comms: Comms | None, padded: bool = False):
        ep = ep_comms.world_size if ep_comms is not None else 1
        if cfg.n_expert % ep:
            raise ValueError(f"n_expert ({cfg.n_expert}) must be divisible by ep ({ep})")
        super().__init__(cfg, mlp_factory, n_local_expert=cfg.n_expert // ep)  # this rank's experts
        self.ep_comms, self.dp_comms, self.padded = ep_comms, dp_comms, padded
        self.n_local = cfg.n_expert // ep
        self.n_local_tokens = 0  # of the last forward (the padded dispatch's rows per peer: k times it)
        for p in self.experts.parameters():
            p.ep_sharded = ep > 1  # the data-parallel strategy leaves them to sync_expert_grads

    def token_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.dp_comms
        if g is None or g.world_size == 1:
            return super().token_counts(counts)
        every = counts.new_empty(g.world_size * counts.numel())
        g.all_gather(every, counts.reshape(-1).contiguous())
        every = every.view(g.world_size, *counts.shape)  # (ranks in data order, k, E)
        return every[:g.rank].sum(0), every.sum(0)

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ep_comms.world_size if self.ep_comms is not None else 1
        if ep == 1:
            return super().run_experts(x, counts)
        send_counts = counts.view(ep, self.n_local)
        pad = self.top_k * self.n_local_tokens  # the most rows one rank can send to one peer
        recv, recv_counts = dispatch(x, send_counts, self.ep_comms, self.padded, pad)
        # recv is grouped by source rank, then expert: regroup by expert for the local experts
        rc = recv_counts.reshape(-1).tolist()  # index src * n_local + e
        starts = [sum(rc[:i]) for i in range(len(rc))]
        perm = [i for e in range(self.n_local) for src in range(ep)
                for i in range(starts[src * self.n_local + e], starts[src * self.n_local + e] + rc[src * self.n_local + e])]
        perm = torch.tensor(perm, dtype=torch.long, device=x.device)
        y = self.experts(recv[perm], recv_counts.sum(0).tolist())  # (R, C) by expert
        y = y[torch.argsort(perm)]  # back to the order it arrived in
        return combine(y, send_counts, recv_counts, self.ep_comms, self.padded, pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n_local_tokens = x.shape[0] * x.shape[1]  # (B, T/cp, C): this rank's tokens
        return super().forward(x)


@torch.no_grad()
def sync_expert_grads(module: torch.nn.Module, edp_comms: Comms, dp_cp_size: int) -> None:
    """The experts' gradients of the mean loss over the global batch: summed over the replicas
    of this rank's experts (``edp_comms``: dp/ep x cp ranks), divided by dp x cp (module docstring).
    One message for all of them."""
    grads = [p.grad for p in module.parameters() if ep_sharded(p) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if edp_comms.world_size > 1:
        edp_comms.all_reduce(flat)
    flat.div_(dp_cp_size)
    torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])
