"""The step-by-step ring all-reduce of lesson 02 on real gloo ranks, against one process's sum,
and the buffer tables that show it."""

from __future__ import annotations

import pytest
import torch

from course_lib.launch.spawn import run_ranks
from course_lib.notebook.rank_tables import BufferSteps
from course_lib.parallel.data.ring import chunk_indices, ring_all_reduce, ring_chunks, ring_step


def _data(rank: int, n: int) -> torch.Tensor:
    return torch.arange(float(n)) * (rank + 1) + 100 * rank


def _ring_rank(rank: int, world_size: int, n: int):
    import torch.distributed as dist

    full = _data(rank, n)
    chunks = ring_chunks(full, world_size)
    for step in range(world_size - 1):
        ring_step(chunks, "reduce-scatter", step)
    owned = chunks[(rank + 1) % world_size].clone()  # complete after the reduce-scatter phase
    for step in range(world_size - 1):
        ring_step(chunks, "all-gather", step)
    again = _data(rank, n)
    ring_all_reduce(again)
    reference = _data(rank, n)
    dist.all_reduce(reference)
    return full, owned, again, reference


@pytest.mark.parametrize(("world_size", "n"), [(2, 6), (3, 7), (4, 8)])
def test_ring_all_reduce_equals_one_process_sum(world_size, n):
    expected = sum(_data(r, n) for r in range(world_size))  # one process adds the ranks' tensors
    results = run_ranks(_ring_rank, world_size, n, timeout=60)
    for rank, (full, owned, again, reference) in enumerate(results):
        assert torch.equal(full, expected) and torch.equal(again, expected) and torch.equal(reference, expected)
        assert torch.equal(owned, ring_chunks(expected.clone(), world_size)[(rank + 1) % world_size])


def test_each_chunk_travels_once_around_the_ring():
    p = 4
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(p - 1):
            sent = [chunk_indices(phase, step, r, p)[0] for r in range(p)]
            received = [chunk_indices(phase, step, r, p)[1] for r in range(p)]
            assert sorted(sent) == list(range(p))  # every link carries one distinct chunk
            assert received == [sent[(r - 1) % p] for r in range(p)]  # what the left neighbour sent
    with pytest.raises(ValueError, match="step must be from 0 to 2"):
        chunk_indices("all-gather", 3, 0, p)
    with pytest.raises(ValueError, match="at least 4 values"):
        ring_chunks(torch.zeros(3), 4)


def test_buffer_tables_mark_what_changed():
    steps = BufferSteps()
    steps.show([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], "start")
    table = steps.show([torch.tensor([1.0, 6.0]), torch.tensor([3.0, 4.0])], "step")
    assert table.changed.values.tolist() == [[False, True], [False, False]]
    assert repr(table) == "step\n        0   1\nrank 0  1  *6\nrank 1  3   4"
    page = table._repr_html_()
    assert page.count("background-color:#ffe08a") == 1 and "<caption>step</caption>" in page
    assert '<td style="padding:2px 8px;text-align:right;background-color:#ffe08a;font-weight:bold">6</td>' in page
    # three collectives on the same data (lesson 02): each marked against the data, not the table before
    data = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    summed = steps.show([torch.tensor([4.0, 6.0])] * 2, "all-reduce", against=data)
    assert summed.changed.values.tolist() == [[True, True], [True, True]]
    assert steps.show(data, "broadcast", against=data).changed.values.sum() == 0
