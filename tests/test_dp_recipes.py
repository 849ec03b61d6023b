"""Global batch, learning-rate scaling rules and per-rank data, against their sources and the trainer.

Sources:
- Goyal et al. 2017 (arXiv:1706.02677), Sec. 2.1 and 5.1: linear scaling, lr = 0.1 x kn/256 for
  ResNet-50; at a minibatch of 8192 the learning rate is 3.2.
- Krizhevsky 2014 (arXiv:1404.5997), its discussion of larger batches: in theory, multiplying the batch by k, multiply the
  learning rate by sqrt(k) to keep the variance of the gradient step (his experiments found the
  linear rule best in practice); Hoffer et al. 2017 (arXiv:1705.08741).
"""

import math

import pytest
import torch

from course_lib.analysis import dp_recipes as dr


def test_global_batch_and_accumulation():
    assert dr.global_batch_size(12, 4, 8) == 384
    assert dr.grad_accum_for(384, 12, 8) == 4
    with pytest.raises(ValueError, match="cannot be made of micro-batches of 5 on 8 ranks"):
        dr.grad_accum_for(384, 5, 8)
    with pytest.raises(ValueError, match="micro_batch must be a whole number"):
        dr.global_batch_size(0)
    plans = dr.batch_plans(64, [8, 16, 32, 64], [1, 2, 4, 8])
    assert plans and all(dr.global_batch_size(p["micro_batch"], p["grad_accum"], p["ranks"]) == 64 for p in plans)
    assert {"ranks": 8, "micro_batch": 8, "grad_accum": 1, "global_batch": 64} in plans
    assert not any(p["ranks"] * p["micro_batch"] > 64 for p in plans)


def test_lr_rules_match_their_papers():
    assert dr.scale_lr(0.1, 256, 8192, "linear") == pytest.approx(3.2)  # Goyal et al., ResNet-50 at 8k
    assert dr.scale_lr(0.1, 256, 256 * 4, "sqrt") == pytest.approx(0.2)  # k = 4 -> sqrt(k) = 2
    assert dr.scale_lr(1e-3, 64, 32, "sqrt") == pytest.approx(1e-3 / math.sqrt(2))  # smaller batch
    with pytest.raises(ValueError, match="rule must be one of"):
        dr.scale_lr(0.1, 1, 2, "cubic")


def test_shards_are_disjoint_and_cover_an_epoch():
    n, world = 100, 4
    shards = [dr.rank_samples("shard", n, n // world, r, world, seed=3) for r in range(world)]
    assert torch.cat(shards).sort().values.tolist() == list(range(n))
    with pytest.raises(ValueError, match="each of 4 ranks 25; ask for at most"):
        dr.rank_samples("shard", n, 26, 0, world)


def test_seeds_differ_per_rank_and_same_seed_repeats():
    a, b = (dr.rank_samples("seed", 50, 20, r, 2, seed=1) for r in (0, 1))
    assert not torch.equal(a, b)
    c, d = (dr.rank_samples("same_seed", 50, 20, r, 2, seed=1) for r in (0, 1))
    assert torch.equal(c, d) and dr.duplicate_fraction(c, d) == 1.0


def test_chance_overlap_matches_its_expectation():
    n, k = 1000, 500
    fractions = [dr.duplicate_fraction(dr.rank_samples("seed", n, k, 0, 2, s),
                                       dr.rank_samples("seed", n, k, 1, 2, s)) for s in range(10)]
    assert sum(fractions) / len(fractions) == pytest.approx(dr.expected_overlap(n, k), abs=0.03)
    assert dr.expected_overlap(n, k) == pytest.approx(1 - 0.999 ** 500)
    rows = {r["method"]: r for r in dr.overlap_table(n, 100)}
    assert rows["shard"]["shared with rank 0"] == 0.0 and rows["same_seed"]["shared with rank 0"] == 1.0


def test_global_slice_is_what_the_trainer_reads():
    from course_lib.gpt.data import TrainBatches

    tokens = torch.arange(500, dtype=torch.long)  # token i at position i: a window's first token is its start
    block, b, world, seed = 8, 5, 3, 11
    for rank in range(world):
        x, _ = TrainBatches(tokens, b, block, 1, rank, world, seed).next()  # (accum, B, T)
        expected = dr.rank_samples("global_slice", tokens.numel() - block, b, rank, world, seed)
        assert x[0, :, 0].tolist() == expected.tolist()
