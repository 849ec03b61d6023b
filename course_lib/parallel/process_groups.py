"""The dp x pp x cp x tp grid: which ranks work together in each kind of parallelism.

world_size = dp * pp * cp * tp ranks are laid out with tensor parallelism innermost (neighbouring
ranks, i.e. GPUs of one node on its fastest links: TP communicates in every layer), then context
parallelism (a ring exchange per attention layer), then data parallelism, then pipeline stages
outermost (Megatron-LM's default order "tp-cp-ep-dp-pp", "tp-cp-dp-pp" without experts: the ``order``
argument of ``initialize_model_parallel`` in Megatron-Core's ``parallel_state.py``; why tensor
parallelism stays inside a node: Narayanan et al. 2021, Sec. 3):

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

Each rank belongs to one group of each kind: its ``tp_group`` (the tp ranks sharing its layers),
its ``cp_group`` (the cp ranks holding the other chunks of its sequences), its ``dp_group`` (the dp
replicas of its shard), its ``pp_group`` (the pp stages of its pipeline) and its ``dp_cp_group``
(dp x cp ranks: the ones whose gradients are averaged, since cp ranks see different tokens of the
same samples). Example, 8 ranks as dp=2, tp=2, pp=2 (cp=1):

    tp groups [0,1] [2,3] [4,5] [6,7]    dp groups [0,2] [1,3] [4,6] [5,7]    pp groups [0,4] [1,5] [2,6] [3,7]

Expert parallelism (a mixture of experts, :mod:`course_lib.parallel.expert`) is carved out of dp,
as in Megatron-LM's expert-model-parallel groups and DeepSeek-V3 (Sec. 3.2): ``ep`` divides dp,
ep innermost within it (``dp_rank = edp_rank * ep + ep_rank``, so an ep group is neighbouring dp
ranks). Its ``ep_group`` holds the ep ranks that share out the experts (the all-to-all); its
``edp_cp_group`` the replicas of one expert shard (dp/ep x cp ranks: expert gradients are averaged
there). Example, 4 ranks as dp=4 with ep=2: ep groups [0,1] [2,3], edp_cp groups [0,2] [1,3].
"""

from __future__ import annotations

import torch.distributed as dist

from course_lib.parallel.comms import Comms
from course_lib.utils import check_count

KINDS = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp_cp")


def check_grid(dp: int, tp: int, pp: int, world_size: int, cp: int = 1, ep: int = 1) -> None:
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        check_count(name, value)
    if dp * tp * pp * cp != world_size:
        sizes = f"dp x tp x pp = {dp} x {tp} x {pp}" if cp == 1 else f"dp x tp x pp x cp = {dp} x {tp} x {pp} x {cp}"
        raise ValueError(f"{sizes} = {dp * tp * pp * cp} does not equal the "
                         f"world size {world_size}; choose sizes whose product is {world_size} "
                         f"(or launch {dp * tp * pp * cp} processes)")
    check_ep(dp, ep)


def check_ep(dp: int, ep: int) -> None:
    """The expert-parallel degree: a count (>= 1) that divides dp."""
    check_count("ep", ep)
    if dp % ep:
        raise ValueError(f"ep ({ep}) must divide dp ({dp}): expert-parallel groups are carved out of dp")


def grid_coords(rank: int, dp: int, tp: int, pp: int, cp: int = 1) -> tuple[int, int, int, int]:
    """(dp_rank, tp_rank, pp_rank, cp_rank) of a global rank."""
    if not 0 <= rank < dp * tp * pp * cp:
        raise ValueError(f"rank {rank} is outside a grid of {dp * tp * pp * cp} ranks")
    return (rank // (tp * cp)) % dp, rank % tp, rank // (tp * cp * dp), (rank // tp) % cp


def grid_rank(dp_rank: int, tp_rank: int, pp_rank: int, dp: int, tp: int, cp_rank: int = 0, cp: int = 1) -> int:
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def group_ranks(dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> dict[str, list[list[int]]]:
    """Every group of each kind, as lists of global ranks."""
    def r(d, t, p, c):
        return grid_rank(d, t, p, dp, tp, c, cp)
    check_ep(dp, ep)
    D, T, P, C = range(dp), range(tp), range(pp), range(cp)
    EP, EDP = range(ep), range(dp // ep)
    return {
        "ep": [[r(e * ep + q, t, p, c) for q in EP] for p in P for e in EDP for c in C for t in T],
        "edp_cp": [sorted(r(e * ep + q, t, p, c) for e in EDP for c in C) for p in P for q in EP for t in T],
        "tp": [[r(d, t, p, c) for t in T] for p in P for d in D for c in C],
        "cp": [[r(d, t, p, c) for c in C] for p in P for d in D for t in T],
        "dp": [[r(d, t, p, c) for d in D] for p in P for c in C for t in T],
        "pp": [[r(d, t, p, c) for p in P] for d in D for c in C for t in T],
        "dp_cp": [sorted(r(d, t, p, c) for d in D for c in C) for p in P for t in T],
    }


class ProcessGroupGrid:
    """This rank's place in the grid and its groups (with byte-counting Comms on each).

    A collective call: every rank must create the grid with the same sizes, since each
    ``dist.new_group`` involves all ranks.
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("ProcessGroupGrid needs torch.distributed to be initialised first")
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        check_grid(dp, tp, pp, self.world_size, cp, ep)  # before any group is made: every rank refuses alike
        self.dp_world_size, self.tp_world_size, self.pp_world_size, self.cp_world_size = dp, tp, pp, cp
        self.dp_rank, self.tp_rank, self.pp_rank, self.cp_rank = grid_coords(self.rank, dp, tp, pp, cp)
        self.ep_world_size, self.ep_rank, self.edp_world_size = ep, self.dp_rank % ep, dp // ep
        self.ranks: dict[str, list[int]] = {}
        groups = {}
        for kind, all_groups in group_ranks(dp, tp, pp, cp, ep).items():
            for ranks in all_groups:  # every rank creates every group, in the same order
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    groups[kind], self.ranks[kind] = group, ranks
        self.dp_group, self.tp_group, self.pp_group = groups["dp"], groups["tp"], groups["pp"]
        self.cp_group, self.dp_cp_group = groups["cp"], groups["dp_cp"]
        self.dp_comms, self.tp_comms, self.pp_comms = (Comms(groups[k]) for k in ("dp", "tp", "pp"))
        self.cp_comms = Comms(groups["cp"])
        self.ep_group, self.edp_cp_group = groups["ep"], groups["edp_cp"]

    @property
    def pp_is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def pp_is_last(self) -> bool:
        return self.pp_rank == self.pp_world_size - 1

    def __repr__(self) -> str:
        return (f"ProcessGroupGrid(rank={self.rank}: dp_rank={self.dp_rank}/{self.dp_world_size}, "
                f"tp_rank={self.tp_rank}/{self.tp_world_size}, pp_rank={self.pp_rank}/{self.pp_world_size}, "
                f"cp_rank={self.cp_rank}/{self.cp_world_size}, ep_rank={self.ep_rank}/{self.ep_world_size})")
