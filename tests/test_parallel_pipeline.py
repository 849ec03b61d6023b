"""Pipeline parallelism equals one process, and its bubble is the published one.

A toy MLP and a GPT whose embedding is tied to its LM head (the copies on the first and last
stage exchange gradients) are split into 2 and 4 stages on gloo ranks and trained for 10 AdamW
steps with 4 micro-batches, under both schedules; loss and every parameter must match the
single-process reference to ~1e-6. The bubble measured on the schedule's logical clock must be
(p - 1) / (m + p - 1) (GPipe, Huang et al. 2019, Sec. 2.3; Narayanan et al. 2021, Sec. 2.2.1: (p - 1) / m
of the ideal time), and
1F1B must hold at most p - r micro-batches' activations on stage r where GPipe holds all m.
"""

from __future__ import annotations

import copy

import pytest
import torch

from course_lib.gpt.model import GPT, GPTConfig
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.comms import Comms
from course_lib.parallel.pipeline.schedules import (
    SCHEDULES,
    Pipeline,
    gpt_stage,
    mlp_stage,
    schedule_ops,
    split_layers,
)
from course_lib.parallel.toy import ToyMLP, adamw, toy_batch

STEPS, N_MICRO, BATCH, TOL = 10, 4, 8, 1e-6
GPT_CFG = GPTConfig(block_size=8, vocab_size=29, n_layer=4, n_head=2, n_embd=16, bias=False)


def make(kind: str):
    torch.manual_seed(0)
    return ToyMLP(n_layers=4) if kind == "toy" else GPT(GPT_CFG)


def batch(kind: str, step: int):
    if kind == "toy":
        return toy_batch(BATCH, seed=step)
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, GPT_CFG.vocab_size, (BATCH, GPT_CFG.block_size + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def pp_worker(rank: int, world_size: int) -> dict:
    comms = Comms()
    out = {}
    for kind in ("toy", "gpt"):
        for schedule in SCHEDULES:
            ref = make(kind)
            split = mlp_stage if kind == "toy" else gpt_stage
            stage = split(copy.deepcopy(ref), rank, world_size)
            pipe = Pipeline(stage, comms, schedule)
            ref_opt, opt = adamw(ref), adamw(stage)
            loss_diff = 0.0
            for step in range(STEPS):
                x, y = batch(kind, step)
                ref_opt.zero_grad(set_to_none=True)
                ref_loss = ref(x, y)[1]
                ref_loss.backward()
                ref_opt.step()
                opt.zero_grad(set_to_none=True)
                loss, stats = pipe.train_step(x, y, N_MICRO)
                opt.step()
                loss_diff = max(loss_diff, abs(loss - ref_loss.item()))
            ref_state = ref.state_dict()
            out[kind, schedule] = {
                "loss": loss_diff,
                "params": max((p.detach() - ref_state[n]).abs().max().item()
                              for n, p in stage.names.items()),
                "names": sorted(stage.names), "bubble": stats.bubble,
                "peak_in_flight": stats.peak_in_flight, "bubble_wall": stats.bubble_wall}
    try:
        pipe.train_step(*batch("toy", 0), n_micro=3)
    except ValueError as e:
        out["indivisible"] = str(e)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_equals_single_process_with_the_published_bubble(world_size):
    p, m = world_size, N_MICRO
    results = run_ranks(pp_worker, world_size)
    for kind, model in (("toy", make("toy")), ("gpt", make("gpt"))):
        all_names = set(model.state_dict())
        for schedule in SCHEDULES:
            covered = set()
            for rank, res in enumerate(results):
                r = res[kind, schedule]
                assert r["loss"] < TOL and r["params"] < TOL, (kind, schedule, rank, r)
                assert r["bubble"] == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
                assert r["peak_in_flight"] == (m if schedule == "afab" else min(m, p - rank))
                covered |= set(r["names"])
            assert covered == all_names  # every parameter lives on some stage (lm_head: a copy)
    assert "batch size 8 is not divisible by n_micro=3" in results[0]["indivisible"]


def test_schedules_and_splits():
    # 1F1B on the first of 4 stages with 8 micro-batches: 3 warm-up forwards, then F/B pairs
    ops = schedule_ops("1f1b", 8, 0, 4)
    assert ops[:5] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
    assert sorted(ops) == sorted(schedule_ops("afab", 8, 0, 4))  # the same work, reordered
    assert schedule_ops("1f1b", 8, 3, 4)[:2] == [("F", 0), ("B", 0)]  # last stage: no warm-up
    assert [len(r) for r in split_layers(10, 4)] == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="cannot split 2 layers into pp_world_size=4 stages"):
        split_layers(2, 4)
    with pytest.raises(ValueError, match="schedule must be one of"):
        schedule_ops("interleaved", 4, 0, 2)
