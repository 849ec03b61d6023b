"""Lesson 10's tensor-parallel MLP taken apart across cells, on 2 and 4 real gloo ranks, against
the dense MLP of one process."""

from __future__ import annotations

import pytest
import torch

from course_lib.experiments.tp_walkthrough import TPLayer, compare_with_dense, shard_shapes
from course_lib.launch.spawn import run_ranks

N_EMBD = 8


def _x():
    return torch.randn(2, 3, N_EMBD, generator=torch.Generator().manual_seed(1))


def _layer(rank, world_size):
    layer = TPLayer(n_embd=N_EMBD)
    return layer.shards(), layer.forward_parts(_x())


@pytest.mark.parametrize("tp", [2, 4])
def test_shards_are_the_dense_layer_cut_and_their_parts_sum_to_it(tp):
    results = run_ranks(_layer, tp, timeout=60)
    shards, parts = [s for s, _ in results], [p for _, p in results]
    table = shard_shapes(shards)
    assert table.loc[("c_fc.weight", 0), "shape"] == (4 * N_EMBD // tp, N_EMBD)  # split by output rows
    assert table.loc[("c_proj.weight", tp - 1), "shape"] == (N_EMBD, 4 * N_EMBD // tp)  # by input columns
    assert table.loc[("c_proj.bias", 1), "shape"] == (N_EMBD,)  # whole on every rank
    assert parts[0]["hidden"].shape == (2, 3, 4 * N_EMBD // tp)
    gaps = compare_with_dense(shards, parts, N_EMBD, _x())
    alone = gaps.pop("one rank's partial alone")
    assert (gaps < 1e-6).all(), gaps
    assert alone > 1e-3  # a single rank's partial product is not the output: the all-reduce is needed
