"""Notebook 5's experiments (experiments/model_parallel_check) on real gloo processes, against one
process computing the same thing.

Pipeline bubble: (p - 1) / (m + p - 1) of a step (Huang et al. 2019, GPipe, Sec. 2.3; Narayanan
et al. 2021, Sec. 2.2.1: (p - 1) / m of the ideal time), for AFAB and 1F1B alike; 1F1B keeps at most p - r micro-batches in
flight on stage r, AFAB all m (Narayanan et al. 2021, Sec. 2.2.1).

Communication counts follow Megatron-LM (Shoeybi et al. 2019, Sec. 3): one all-reduce in forward
(g) and one in backward (f) per parallel MLP or attention, so 2 per transformer block each way;
a ring all-reduce sends 2 (N-1)/N of the buffer per rank (Patarasuk and Yuan 2009).
"""

from __future__ import annotations

import pytest

from course_lib.experiments.model_parallel_check import (
    compare_split_weights,
    compare_tensor_parallel,
    measure_pipeline_bubble,
)
from course_lib.launch.spawn import run_ranks
from course_lib.notebook.plots import plot_pipeline_bubble

B, D, OUT = 8, 36, 20


def _both(rank, world_size):
    split = compare_split_weights(B, D, OUT, repeats=1)
    tp = compare_tensor_parallel(n_embd=48, n_head=6, n_layer=3, batch=2, block_size=8) \
        if world_size in (2, 3) else None
    return split, tp


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_split_weights_and_tensor_parallel(world_size):
    results = run_ranks(_both, world_size)
    y_bytes = B * OUT * 4
    for rank, (split, tp) in enumerate(results):
        assert split["W bytes (this rank)"] * world_size == split["W bytes (whole)"] == D * OUT * 4
        # the chain: only the last rank holds y; every other rank sends one partial sum
        if rank == world_size - 1:
            assert split["chain: max |y - xW|"] < 1e-4
            assert split["chain: sent bytes"] == 0
        else:
            assert split["chain: max |y - xW|"] is None
            assert split["chain: sent bytes"] == y_bytes
        assert split["all_reduce: max |y - xW|"] < 1e-4
        assert split["all_reduce: sent bytes"] == pytest.approx(2 * (world_size - 1) / world_size * y_bytes)

        assert tp["mlp: max |y - y_ref|"] < 1e-5 and tp["mlp: max |dx - dx_ref|"] < 1e-5
        assert (tp["mlp: all-reduces forward"], tp["mlp: all-reduces backward"]) == (1, 1)
        assert tp["mlp: c_fc weight shape (this rank)"] == (4 * 48 // world_size, 48)
        assert tp["gpt: loss (tensor parallel)"] == pytest.approx(tp["gpt: loss (one process)"], abs=1e-5)
        assert tp["gpt: max grad diff (replicated params)"] < 1e-5
        assert tp["gpt: all-reduces forward"] == 2 * 3
        assert tp["gpt: all-reduces forward + backward"] == 4 * 3
        assert tp["gpt: param MB (this rank)"] < tp["gpt: param MB (one process)"]


def test_chain_rejects_an_uneven_split():
    import torch

    from course_lib.experiments.model_parallel_check import chain_matmul

    class OneOfThree:
        world_size, rank = 3, 0

    with pytest.raises(ValueError, match="divide into 3 ranks"):
        chain_matmul(torch.ones(2, 4), torch.ones(4, 2), OneOfThree())


def _pipeline(rank, world_size):
    return measure_pipeline_bubble(n_micros=(1, 3, 6), n_layer=4, n_embd=16, n_head=2, block_size=8)


@pytest.mark.timeout(120)
def test_pipeline_bubble_and_memory_on_three_stages():
    p = 3
    every_rank = run_ranks(_pipeline, p)
    for rank, rows in enumerate(every_rank):
        assert len(rows) == 2 * 3
        for row in rows:
            m = row["m"]
            assert row["bubble (ticks)"] == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
            assert row["(p-1)/(m+p-1)"] == pytest.approx((p - 1) / (m + p - 1))
            assert row["loss"] == pytest.approx(row["loss (one process)"], abs=1e-5)
            expected = m if row["schedule"] == "afab" else min(m, p - rank)
            assert row["micro-batches in flight"] == expected, row
    # the figure: the formula as a line, and per schedule the mean bubble over stages at each m
    fig = plot_pipeline_bubble([row for rows in every_rank for row in rows])
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert set(lines) == {"(p-1)/(m+p-1)", "afab, logical clock", "afab, wall time",
                          "1f1b, logical clock", "1f1b, wall time"}
    ticks = lines["1f1b, logical clock"]
    assert list(ticks.get_xdata()) == [1, 3, 6]
    assert list(ticks.get_ydata()) == pytest.approx([(p - 1) / (m + p - 1) for m in (1, 3, 6)])
    with pytest.raises(ValueError, match="rows of measure_pipeline_bubble"):
        plot_pipeline_bubble([])
