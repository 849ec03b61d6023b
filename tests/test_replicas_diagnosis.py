"""check_replicas names a parameter used on one rank only, and left out of the gradient sync, as
missing from the sync, not as a sum: on the rank that used it, its own gradient *is* the sum of the
ranks' local gradients (the others' are zero), so only the other ranks tell the two bugs apart.

    .venv/bin/python -m pytest -q tests/test_replicas_diagnosis.py
"""

from __future__ import annotations

from course_lib.launch.spawn import run_ranks


def one_rank_branch_worker(rank: int, world_size: int) -> dict[str, str]:
    """Layer ``b`` runs on rank 0 only. Four hand-written syncs after the same backward: ``b.weight``
    left out (its gradient None on the other ranks, or zeros: the sync filled the missing gradients
    first), every gradient summed, and, to pin the resolution down, a step that averages ``b.weight``
    and all but rank 0 left unsynced (``b.weight`` is then rank 0's own and the sum at once on rank 0,
    and nothing on the other ranks tells which: the report says both)."""
    import torch
    from torch import nn

    from course_lib.parallel.replicas import check_replicas, local_grads

    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x, use_b):
            h = self.a(x)
            return self.c(self.b(h) if use_b else h).sum()

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    said = {}
    for sync in ("skip, none elsewhere", "skip, zeros elsewhere", "sum", "rank 0 unsynced"):
        torch.manual_seed(0)
        model = Branch()
        model(x, use_b=rank == 0).backward()
        mine = local_grads(model)
        for n, p in model.named_parameters():
            if sync == "skip, zeros elsewhere" and p.grad is None:
                p.grad = torch.zeros_like(p)
            if n == "b.weight" and sync.startswith("skip"):
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            synced = p.grad.clone()
            torch.distributed.all_reduce(synced)
            if sync == "rank 0 unsynced" and rank == 0 and n == "b.weight":
                continue  # rank 0 took part in the all-reduce, but kept its own gradient
            p.grad.copy_(synced / (1 if sync == "sum" else world_size))
        said[sync] = str(check_replicas(model, batch=x, local=mine))
    return said


def test_a_parameter_used_on_one_rank_and_left_out_of_the_sync_is_not_called_a_sum():
    own = "is this rank's own gradient: the parameter is missing from the gradient sync"
    for rank, said in enumerate(run_ranks(one_rank_branch_worker, 2, timeout=30)):
        none, zeros, summed, unsynced = (said[k] for k in ("skip, none elsewhere", "skip, zeros elsewhere",
                                                           "sum", "rank 0 unsynced"))
        # rank 1 holds no gradient of b.weight: the sets differ, and rank 0's is its own, not a sum
        assert "the ranks hold different sets of tensors" in none, (rank, none)
        assert f"gradient 'b.weight' (rank 0) {own}" in none, (rank, none)
        assert "SUM" not in none, (rank, none)
        # rank 1 holds zeros (its own): both ranks named, the gradients differ, no sum anywhere
        assert "gradient 'b.weight' differs: rank 0 norm" in zeros, (rank, zeros)
        assert f"gradient 'b.weight' (rank 0, 1) {own}" in zeros, (rank, zeros)
        assert "SUM" not in zeros, (rank, zeros)
        # a real sum of b.weight (rank 0's own gradient too, but rank 1 holds the same sum): a sum
        assert "gradient 'b.weight' (rank 0, 1) is the SUM of the ranks' gradients" in summed, (rank, summed)
        assert "gradient 'a.weight' (rank 0, 1) is the SUM" in summed, (rank, summed)
        assert "missing from the gradient sync" not in summed, (rank, summed)
        # rank 1 averaged, rank 0 kept its own: on rank 0 the sum and its own are the same tensor,
        # and rank 1 (which holds the mean) does not say which: both named, neither claimed
        assert "gradient 'b.weight' differs: rank 0 norm" in unsynced, (rank, unsynced)
        assert ("gradient 'b.weight' (rank 0) is both this rank's own gradient and the SUM of the ranks' "
                "gradients") in unsynced, (rank, unsynced)
        assert unsynced.count("gradient 'b.weight' (rank") == 1, (rank, unsynced)
