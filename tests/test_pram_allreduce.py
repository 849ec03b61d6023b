"""course_lib.pram.allreduce: the ring all-reduce as an EREW program.

Counts from Patarasuk & Yuan, JPDC 69(2), 2009: reduce-scatter and all-gather of p - 1 steps
each, every rank sending N/p values per step, 2(p - 1)N/p in all.
"""

from __future__ import annotations

import pytest
import torch

from course_lib import pram
from course_lib.pram.allreduce import ring_allreduce, ring_allreduce_counts


@pytest.mark.parametrize("p,N", [(2, 2), (2, 6), (3, 6), (4, 8), (8, 16)])
def test_ring_allreduce_sums_every_row_on_erew(p, N):
    prog = ring_allreduce(p, N, seed=p)
    result = pram.run(prog, "EREW", trace=False)
    assert prog.verify(result) == []
    start = torch.tensor(prog.memory["G"].data, dtype=torch.float64).view(p, N)
    final = torch.tensor(result["G"], dtype=torch.float64)
    torch.testing.assert_close(final, start.sum(0).expand(p, N), rtol=1e-12, atol=1e-12)
    counts = ring_allreduce_counts(p, N)
    assert (result.steps, result.work, result.processors) == \
        (counts["steps"], counts["work"], counts["processors"]) == (2 * (p - 1), 2 * (p - 1) * N, N)
    assert result.ops == {"add": (p - 1) * N, "copy": (p - 1) * N}
    assert counts["sent_per_rank"] == 2 * (p - 1) * N // p


def test_every_step_touches_each_cell_once():
    prog = ring_allreduce(4, 8)
    result = pram.run(prog, "EREW")
    assert result.max_readers.count <= 1 and result.max_writers.count <= 1
    # reduce-scatter: each processor reads its own cell and its left neighbour's, writes its own
    for t in result.trace[:3]:
        assert len(t.reads) == 2 * 8 and len(t.writes) == 8
    assert pram.classify(prog).model == "EREW"


def test_ring_allreduce_rejects_bad_input():
    with pytest.raises(ValueError, match="divisible by p"):
        ring_allreduce(4, 6)
    with pytest.raises(ValueError, match="p >= 2"):
        ring_allreduce(1, 4)
    with pytest.raises(ValueError, match="N must be a positive integer"):
        ring_allreduce_counts(2, 0)
