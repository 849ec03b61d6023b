"""The dp x tp x pp grid: the right ranks in each group, clear errors, and 2-D parallelism
(data parallel over tensor-parallel GPTs, dp=2 x tp=2 on 4 gloo ranks) equal to one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from course_lib.gpt.model import GPT, GPTConfig
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.data.ddp import DataParallelBucket
from course_lib.parallel.process_groups import (
    ProcessGroupGrid,
    check_grid,
    grid_coords,
    group_ranks,
)
from course_lib.parallel.tensor.layers import tensor_parallel_gpt
from course_lib.parallel.toy import adamw

GRIDS = [(2, 2, 1), (1, 2, 2), (2, 1, 2), (4, 1, 1), (1, 1, 4)]
GPT_CFG = GPTConfig(block_size=8, vocab_size=29, n_layer=2, n_head=2, n_embd=16, bias=False)
STEPS = 10


def grid_worker(rank: int, world_size: int) -> dict:
    out = {}
    for dp, tp, pp in GRIDS:
        grid = ProcessGroupGrid(dp=dp, tp=tp, pp=pp)
        sums = {}
        for kind in ("dp", "tp", "pp"):  # a sum over the group tells who is in it
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=getattr(grid, f"{kind}_group"))
            sums[kind] = (t.item(), sum(grid.ranks[kind]))
        out[dp, tp, pp] = {"coords": (grid.dp_rank, grid.tp_rank, grid.pp_rank, grid.cp_rank), "sums": sums}

    # dp=2 x tp=2: each dp replica is a tensor-parallel GPT; float64 so the check is exact
    grid = ProcessGroupGrid(dp=2, tp=2)
    torch.manual_seed(0)
    ref = GPT(GPT_CFG).double()
    model = DataParallelBucket(tensor_parallel_gpt(copy.deepcopy(ref), grid.tp_comms),
                               comms=grid.dp_comms)
    ref_opt, opt = adamw(ref), adamw(model)
    g = torch.Generator().manual_seed(0)
    loss_diff = 0.0
    for _ in range(STEPS):
        idx = torch.randint(0, GPT_CFG.vocab_size, (8, GPT_CFG.block_size + 1), generator=g)
        x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = ref(x, y)[1]
        ref_loss.backward()
        ref_opt.step()
        mine = slice(4 * grid.dp_rank, 4 * (grid.dp_rank + 1))  # this replica's half of the batch
        opt.zero_grad(set_to_none=True)
        loss = model(x[mine], y[mine])[1]
        loss.backward()
        model.finish_gradient_synchronization()
        opt.step()
        total = loss.detach().clone()
        grid.dp_comms.all_reduce(total)
        loss_diff = max(loss_diff, abs(total.item() / 2 - ref_loss.item()))
    want = tensor_parallel_gpt(ref, grid.tp_comms).state_dict()
    got = model.module.state_dict()
    out["2d"] = {"loss": loss_diff, "params": max((got[k] - want[k]).abs().max().item() for k in want)}
    return out


@pytest.mark.timeout(120)
def test_grid_groups_and_2d_parallelism_on_4_ranks():
    results = run_ranks(grid_worker, 4)
    for rank, res in enumerate(results):
        for dp, tp, pp in GRIDS:
            r = res[dp, tp, pp]
            assert r["coords"] == grid_coords(rank, dp, tp, pp)
            for kind, (got, want) in r["sums"].items():
                assert got == want, (rank, (dp, tp, pp), kind)
        assert res["2d"]["loss"] < 1e-12 and res["2d"]["params"] < 1e-10, res["2d"]


def test_layout_is_megatrons():
    """tp innermost (neighbouring ranks), then dp, then pp (the module docstring's example)."""
    groups = group_ranks(dp=2, tp=2, pp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid_coords(5, dp=2, tp=2, pp=2) == (0, 1, 1, 0)


def test_4d_layout_has_cp_between_tp_and_dp():
    """dp=2 x pp=2 x cp=2 x tp=2 on 16 ranks: rank = ((pp*dp + dp_rank)*cp + cp_rank)*tp + tp_rank;
    the gradient group dp x cp holds the ranks that see different tokens of one stage's shard."""
    groups = group_ranks(dp=2, tp=2, pp=2, cp=2)
    assert groups["tp"][:2] == [[0, 1], [2, 3]]
    assert groups["cp"][:2] == [[0, 2], [1, 3]]
    assert groups["dp"][:2] == [[0, 4], [1, 5]]
    assert groups["pp"][:2] == [[0, 8], [1, 9]]
    assert groups["dp_cp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid_coords(13, dp=2, tp=2, pp=2, cp=2) == (1, 1, 1, 0)
    for kind, all_groups in groups.items():  # each rank is in exactly one group of each kind
        assert sorted(r for g in all_groups for r in g) == list(range(16)), kind


def test_bad_grids_are_clear_errors():
    with pytest.raises(ValueError, match=r"dp x tp x pp = 2 x 2 x 2 = 8 does not equal the world "
                                         r"size 4; choose sizes whose product is 4"):
        check_grid(2, 2, 2, world_size=4)
    with pytest.raises(ValueError, match="tp must be a whole number >= 1, got 0"):
        check_grid(4, 0, 1, world_size=4)
    with pytest.raises(ValueError, match="rank 8 is outside a grid of 8 ranks"):
        grid_coords(8, 2, 2, 2)
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialised"):
        ProcessGroupGrid(dp=1)


def test_run_ranks_refuses_bad_input_before_spawning(monkeypatch):
    def never(rank, world_size):
        raise AssertionError("no worker may start")

    with pytest.raises(ValueError, match="nproc must be a whole number >= 1, got 0"):
        run_ranks(never, 0)
    with pytest.raises(ValueError, match="backend must be 'gloo' .* or 'nccl'"):
        run_ranks(never, 2, backend="mpi")
    # NCCL needs a GPU per rank: refused in the parent, before any process starts
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank: 2 ranks, 1 GPU"):
        run_ranks(never, 2, backend="nccl")
