"""The notebook-3 experiment on 2 real gloo processes: every data-parallel variant equals one
process on the global batch, the broadcast makes differently initialised ranks agree, and the
all-reduce counts are what naive (one per parameter) and bucketed (one per bucket) DP must send."""

import pytest

from course_lib.dp_experiments import (
    SMALL_GPT,
    VARIANTS,
    compare_with_single_process,
    summary_rows,
)
from course_lib.parallel.spawn import run_ranks


def _worker(rank, world_size, variants):
    return compare_with_single_process(variants, steps=2)


@pytest.mark.timeout(180)
def test_variants_match_one_process_and_count_their_messages():
    from course_lib.model import GPT, GPTConfig

    results = run_ranks(_worker, 2, args=(VARIANTS,))
    model = GPT(GPTConfig(**SMALL_GPT))
    n_tensors = len(list(model.parameters()))
    grad_mb = sum(p.numel() for p in model.parameters()) * 4 / 1e6
    for rank_results in results:
        assert set(rank_results) == set(VARIANTS)
        for label, r in rank_results.items():
            assert len(set(r["checksums_before"])) == 2, f"{label}: ranks should start different"
            assert len(set(r["checksums_after"])) == 1, f"{label}: the wrapper must broadcast rank 0's weights"
            assert r["max_param_diff"] < 1e-5, label
            assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5)
            assert r["allreduce_MB"] == pytest.approx(grad_mb), label  # every gradient, once per step
    r = results[0]
    assert r["ddp_naive"]["allreduce_calls"] == n_tensors
    assert r["ddp, one big bucket"]["allreduce_calls"] == 1 == r["ddp, one big bucket"]["buckets"]
    small = r["ddp, small buckets"]
    assert small["allreduce_calls"] == small["buckets"] >= 2
    assert 1 <= r["torch_ddp"]["allreduce_calls"] < n_tensors
    rows = summary_rows(r)
    assert [row["variant"] for row in rows] == list(VARIANTS)
    assert all(row["ranks agree after wrap"] and not row["ranks agree before wrap"] for row in rows)
