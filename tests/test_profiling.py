"""course_lib.experiments.profiling and step_intervals: one training step per rank split into compute and communication.

The interval arithmetic is checked on hand-made cases; the profiler on real gloo processes:
communication is found (> 0) on 2 ranks and absent on one, compute and communication together
cover most of the step, the naive DDP (all-reduce after backward, Li et al. 2020 Sec. 3.2.1)
overlaps nothing while bucketed DDP overlaps backward, and the Chrome traces are written.
"""

from __future__ import annotations

import json

import pytest

from course_lib.experiments.profiling import merge_traces, profile_training_step
from course_lib.experiments.step_intervals import classify_events, intersect, merge, subtract, total
from course_lib.notebook.plots import plot_step_timeline

GPT = {"block_size": 32, "vocab_size": 65, "n_layer": 2, "n_head": 2, "n_embd": 64}


def test_interval_arithmetic():
    a = [(5, 8), (0, 2), (1, 3), (10, 10)]  # overlapping, unsorted, one empty
    assert merge(a) == [(0, 3), (5, 8)]
    assert total(a) == 6
    b = [(2, 6), (7, 12)]
    assert intersect(a, b) == [(2, 3), (5, 6), (7, 8)]
    assert subtract(a, b) == [(0, 2), (6, 7)]
    assert subtract(b, a) == [(3, 5), (8, 12)]
    # |a| + |b| - |a ∩ b| = |a ∪ b|
    assert total(a) + total(b) - total(intersect(a, b)) == total(a + b)


def _ev(name, start, end, thread=1, device="cpu"):
    return {"name": name, "thread": thread, "start": start, "end": end, "device": device}


def test_classify_synthetic_step():
    """A 100 us step: forward ops 0-40, backward 40-80 with a bucket all-reduce on gloo's thread
    from 60 to 90, a wait (no event) 80-90, optimizer 90-95, 5 us of nothing."""
    events = [_ev("train_step", 1000, 1100), _ev("forward", 1000, 1040), _ev("aten::linear", 1000, 1040),
              _ev("backward", 1040, 1080), _ev("autograd::engine::evaluate_function: AddmmBackward0", 1040, 1080),
              _ev("c10d::allreduce_", 1060, 1062), _ev("gloo:all_reduce", 1060, 1090, thread=7),
              _ev("Optimizer.step#AdamW.step", 1090, 1095), _ev("gloo:all_reduce", 2000, 2100, thread=7)]
    r = classify_events(events)
    assert r["step_ms"] == pytest.approx(0.100)
    assert r["compute_ms"] == pytest.approx(0.083)  # 0-95 minus the 2 us launch and the 10 us wait
    assert r["comm_ms"] == pytest.approx(0.030)  # the launch lies inside gloo's 60-90
    assert r["overlap_ms"] == pytest.approx(0.018)  # 62-80
    assert r["exposed_comm_ms"] == pytest.approx(0.012)
    assert r["other_ms"] == pytest.approx(0.005)
    assert r["phases"] == {"forward": (0.0, 0.040), "backward": (0.040, 0.080)}
    with pytest.raises(ValueError, match="train_step"):
        classify_events(events[1:])


def test_step_timeline_draws_what_classify_found():
    r = classify_events([_ev("train_step", 0, 100), _ev("forward", 0, 40), _ev("aten::mm", 0, 80),
                  _ev("gloo:all_reduce", 60, 90, thread=7)])
    fig = plot_step_timeline([dict(r, rank=0, strategy="ddp")])
    lanes = fig.axes[0].collections  # broken_barh: one per phase, then compute, then comm
    assert len(lanes) == 3
    def extent(lane):  # (x from, x to) in ms of a lane's bars
        xs = [x for path in lane.get_paths() for x, _ in path.vertices]
        return pytest.approx((min(xs), max(xs)))

    assert extent(lanes[0]) == (0.0, 0.040)  # the forward phase
    assert extent(lanes[1]) == (0.0, 0.080) and extent(lanes[2]) == (0.060, 0.090)  # compute, comm
    assert [lbl.get_text() for lbl in fig.axes[0].get_yticklabels()] == ["rank 0 phases", "compute", "comm"]


def test_classify_gpu_kernels():
    events = [_ev("train_step", 0, 100), _ev("aten::mm", 0, 100),  # CPU side: launches only
              _ev("sm80_xmma_gemm", 10, 50, thread=0, device="cuda"),
              _ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 70, thread=0, device="cuda")]
    r = classify_events(events)
    assert (r["device"], r["compute_ms"], r["comm_ms"], r["overlap_ms"]) == ("cuda", 0.040, 0.030, 0.010)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_gloo_ranks(tmp_path):
    naive = profile_training_step("ddp_naive", 2, gpt=GPT, batch_size=4)
    bucketed = profile_training_step("ddp", 2, gpt=GPT, batch_size=4, trace_dir=tmp_path, bucket_cap_mb=0.02)
    one = profile_training_step("single", 1, gpt=GPT, batch_size=4)
    for r in naive + bucketed:
        assert r["comm_ms"] > 0 and r["compute_ms"] > 0
        # compute and communication cover most of the step; the rest is Python between ops
        assert r["compute_ms"] + r["exposed_comm_ms"] > 0.5 * r["step_ms"], r
        assert r["compute_ms"] + r["exposed_comm_ms"] + r["other_ms"] == pytest.approx(r["step_ms"])
        assert r["step_ms"] <= r["wall_ms"] * 1.05
        assert set(r["phases"]) >= {"forward", "backward", "finish_grads", "optimizer_step"}
    # naive: every all-reduce runs inside finish_grads, after backward: nothing to hide behind
    for r in naive:
        assert r["overlap_ms"] < 0.05 * r["comm_ms"], r
        fin = r["phases"]["finish_grads"]
        assert all(fin[0] - 0.5 <= s and e <= fin[1] + 0.5 for s, e in r["comm"]), (fin, r["comm"])
    # bucketed: the first buckets' all-reduces start while backward still runs
    assert max(r["overlap_ms"] for r in bucketed) > 0
    assert any(s < r["phases"]["backward"][1] for r in bucketed for s, _ in r["comm"])
    assert one[0]["comm_ms"] == 0 and one[0]["compute_ms"] > 0
    # traces: one per rank, and the merged one with both ranks as processes
    merged = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    names = {e.get("name", "") for e in merged["traceEvents"]}
    assert "train_step" in names and any(n.startswith("gloo:all_reduce") for n in names)


def test_merge_traces_aligns_bases(tmp_path):
    a = {"baseTimeNanoseconds": 5_000_000, "traceEvents": [{"name": "x", "ph": "X", "ts": 10.0, "pid": 99}]}
    b = {"baseTimeNanoseconds": 3_000_000, "traceEvents": [{"name": "y", "ph": "X", "ts": 10.0, "pid": 98}]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    out = json.loads(merge_traces([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "m.json").read_text())
    ev = {e["name"]: e for e in out["traceEvents"]}
    assert ev["x"]["pid"] == 0 and ev["y"]["pid"] == 1
    assert ev["x"]["ts"] == 10.0 + 2000.0 and ev["y"]["ts"] == 10.0  # 2 ms later base on rank 0
    assert ev["process_name"]["args"]["name"] == "rank 1"


def test_bad_input():
    with pytest.raises(ValueError, match="unknown strategy"):
        profile_training_step("zero9")
    with pytest.raises(ValueError, match="one rank"):
        profile_training_step("single", 2)
    with pytest.raises(ValueError, match="device"):
        profile_training_step("ddp", device="tpu")
