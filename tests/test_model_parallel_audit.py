"""Pipeline parallelism in the corners, against one process on the same global batch.

Each test trains the stages of tests/test_parallel_pipeline.py (a GPT whose embedding is tied to
its LM head, a toy MLP) on 2 gloo ranks, under both schedules:

* gradients accumulated over two ``train_step`` calls (no zero_grad between them): the tied
  weight's copies must hold the sum of both steps' gradients once, as one process does;
* the tied embedding frozen: the last stage's copy (the LM head) stays frozen too, as the one
  tensor of one process does;
* every parameter of the first stage frozen (fine-tuning the upper layers only): its output needs
  no gradient, and the other stage still trains as one process.
"""

from __future__ import annotations

import copy

import pytest
from test_parallel_pipeline import TOL, batch, make

from course_lib.launch.spawn import run_ranks
from course_lib.parallel.comms import Comms
from course_lib.parallel.pipeline.schedules import SCHEDULES, Pipeline, gpt_stage, mlp_stage
from course_lib.parallel.toy import adamw

STEPS, N_MICRO = 3, 2


def _grad_diff(stage, ref) -> float:
    """Largest difference between the stage's gradients and the reference's, by full-model name."""
    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    worst = 0.0
    for n, p in stage.names.items():
        assert (p.grad is None) == (ref_grads[n] is None), n
        if p.grad is not None:
            worst = max(worst, (p.grad - ref_grads[n]).abs().max().item())
    return worst


def _param_diff(stage, ref) -> float:
    ref_state = ref.state_dict()
    return max((p.detach() - ref_state[n]).abs().max().item() for n, p in stage.names.items())


def _accumulate_worker(rank: int, world_size: int) -> dict:
    out = {}
    for schedule in SCHEDULES:
        ref = make("gpt")
        stage = gpt_stage(copy.deepcopy(ref), rank, world_size)
        pipe = Pipeline(stage, Comms(), schedule)
        for step in range(2):  # two steps' gradients, summed in .grad (as one process does)
            x, y = batch("gpt", step)
            ref(x, y)[1].backward()
            pipe.train_step(x, y, N_MICRO)
        out[schedule] = _grad_diff(stage, ref)
    return out


@pytest.mark.timeout(120)
def test_pipeline_accumulates_the_tied_gradient_across_steps():
    # before: each step summed the copies' whole .grad, so the earlier steps' sum was counted twice
    for rank, res in enumerate(run_ranks(_accumulate_worker, 2, timeout=90)):
        for schedule, diff in res.items():
            assert diff < TOL, (rank, schedule, diff)


def _train(kind: str, rank: int, world_size: int, schedule: str, freeze) -> dict:
    ref = make(kind)
    freeze(ref)
    split = mlp_stage if kind == "toy" else gpt_stage
    stage = split(copy.deepcopy(ref), rank, world_size)
    pipe = Pipeline(stage, Comms(), schedule)
    ref_opt, opt = adamw(ref), adamw(stage)
    for step in range(STEPS):
        x, y = batch(kind, step)
        ref_opt.zero_grad(set_to_none=True)
        ref(x, y)[1].backward()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        pipe.train_step(x, y, N_MICRO)
        opt.step()
    return {"params": _param_diff(stage, ref),
            "trainable": sorted(n for n, p in stage.names.items() if p.requires_grad)}


def _freeze_wte(model) -> None:
    model.transformer.wte.weight.requires_grad_(False)  # and the LM head: one tensor


def _freeze_first_stage(model) -> None:
    for layer in model.layers[:2]:  # stage 0 of 2: layers 0 and 1 of 4
        layer.requires_grad_(False)


def _frozen_worker(rank: int, world_size: int, kind: str) -> dict:
    freeze = _freeze_wte if kind == "gpt" else _freeze_first_stage
    return {schedule: _train(kind, rank, world_size, schedule, freeze) for schedule in SCHEDULES}


@pytest.mark.timeout(120)
def test_pipeline_keeps_a_frozen_tied_embedding_frozen_on_both_stages():
    # before: the last stage's copy (the LM head) trained while the embedding stayed: they drifted
    for rank, res in enumerate(run_ranks(_frozen_worker, 2, "gpt", timeout=90)):
        for schedule, r in res.items():
            assert r["params"] < TOL, (rank, schedule, r)
            assert not {"transformer.wte.weight", "lm_head.weight"} & set(r["trainable"]), (rank, schedule)


@pytest.mark.timeout(120)
def test_pipeline_trains_with_every_parameter_of_the_first_stage_frozen():
    # before: the first stage's output needed no gradient and its backward raised
    results = run_ranks(_frozen_worker, 2, "toy", timeout=90)
    for rank, res in enumerate(results):
        for schedule, r in res.items():
            assert r["params"] < TOL, (rank, schedule, r)
    assert results[0]["1f1b"]["trainable"] == [] and results[1]["1f1b"]["trainable"]
