"""One home for each rule, checked by behaviour: where two modules apply the same rule, they refuse
the same cases with the same words.

* The layout's divisibility rules (heads over tp, blocks over pp, every sequence in 2 cp chunks,
  sequence shards over tp: :func:`course_lib.registry.layout_error`, what a TrainConfig refuses)
  are also what the layout planner (:func:`course_lib.analysis.layout_plan.plan_layouts`) and the
  communication model (:func:`course_lib.analysis.parallel_comm.sent_bytes_per_step`) refuse.
* The device strings a run's configuration accepts (RunConfig) are the ones the rank placement
  accepts (:func:`course_lib.launch.placement.plan_ranks`), and torch can build each of them.
* The learning-rate schedule refuses a decay that ends before the warmup when the run gets there.
"""

from __future__ import annotations

import types

import pytest
import torch

from course_lib.analysis.layout_plan import plan_layouts
from course_lib.analysis.memory import ModelShape, get_preset
from course_lib.analysis.parallel_comm import sent_bytes_per_step
from course_lib.launch.placement import PlanError, plan_ranks
from course_lib.registry import ConfigError
from course_lib.trainer.config import TRAIN_PRESETS, OptimizerConfig, RunConfig, TrainConfig, make_config
from course_lib.trainer.loop import get_lr

# --- 1. the layout's divisibility rules -------------------------------------------------------------


def registry_refusal(n_layer: int, n_head: int, block_size: int, nproc: int, tp: int, pp: int, cp: int,
                     sequence_parallel: bool) -> str | None:
    """What a TrainConfig with this model and layout is refused for (registry.layout_error), or None."""
    try:
        TrainConfig(n_layer=n_layer, n_head=n_head, n_embd=16 * n_head, block_size=block_size, nproc=nproc,
                    tp=tp, pp=pp, cp=cp, sequence_parallel=sequence_parallel)
    except ConfigError as e:
        return str(e)
    return None


# An odd block_size: no rule of the trainer needs an even one without cp; the planner's copy of the
# cp rule (block_size % (2 cp)) asked for one at cp = 1 too, and listed no layout at all.
ODD = ModelShape("odd", n_layer=4, n_head=4, n_embd=64, block_size=63, vocab_size=65, batch_size=1)


@pytest.mark.parametrize("model", [ODD, "shakespeare_char", "gpt2-large"], ids=lambda m: getattr(m, "name", m))
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_the_planner_lists_the_layouts_the_trainer_accepts(model, sequence_parallel):
    """Every dp x tp x pp x cp on 8 GPUs that the planner lists is one a TrainConfig accepts, and
    every one it accepts is listed (sequence parallelism only where tp > 1, as the planner uses it)."""
    world, shape = 8, get_preset(model)
    rows = plan_layouts(shape, n_nodes=1, gpus_per_node=world, global_batch=world, cp_options=(1, 2, 4),
                        sequence_parallel=sequence_parallel)
    listed = {(r["tp"], r["pp"], r["cp"]) for r in rows}
    accepted = {(tp, pp, cp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) for cp in (1, 2, 4)
                if world % (tp * pp * cp) == 0
                and registry_refusal(shape.n_layer, shape.n_head, shape.block_size, world, tp, pp, cp,
                                     sequence_parallel and tp > 1) is None}
    assert accepted, "the cases should include layouts the trainer runs"
    assert listed == accepted


SMALL = dict(n_embd=64, vocab_size=65, bias=True, batch_size=2, micro_batches=1)


@pytest.mark.parametrize("n_layer, block_size, tp, pp, cp, sp", [
    (4, 32, 2, 2, 1, False),  # accepted
    (5, 32, 1, 2, 1, False),  # 5 blocks on 2 stages
    (4, 32, 1, 1, 3, False),  # 32 tokens in 2 x 3 chunks
    (4, 36, 2, 1, 3, True),  # accepted: 6 chunks of 6, 12 tokens per cp rank over tp = 2
    (4, 30, 4, 1, 1, True),  # 30 tokens over 4 sequence shards
    (4, 20, 4, 1, 2, True),  # 10 tokens per cp rank over 4 sequence shards
])
def test_the_comm_model_refuses_what_the_trainer_refuses(n_layer, block_size, tp, pp, cp, sp):
    """The closed-form bytes answer for the layouts the trainer runs, and refuse the others with the
    trainer's own words (instead of flooring s/cp or s/tp and counting another model)."""
    want = registry_refusal(n_layer, 4, block_size, tp * pp * cp, tp, pp, cp, sp)
    try:
        sent_bytes_per_step(n_layer=n_layer, block_size=block_size, tp=tp, pp=pp, cp=cp, sequence_parallel=sp,
                            **SMALL)
        got = None
    except ValueError as e:
        got = str(e)
    assert got == want


# --- 2. the device string ---------------------------------------------------------------------------

ACCEPTED = ("auto", "cpu", "cuda", "cuda:0", "cuda:7", "cuda:10")
# "cuda:", "cpu:", "auto:": the placement took them (a bare ':' read as no index) while RunConfig
# refused them; "cuda:01", "cuda:²", "cuda:٣": both took them (str.isdigit), torch.device refuses
# them, and the placement's int("²") raised a bare ValueError
REFUSED = ("cuda:", "cpu:", "auto:", "cuda:01", "cuda:²", "cuda:٣", "cuda:-1", "cuda:0:1", "cpu:0", "gpu", "tpu",
           "CUDA", " cuda", "cuda ", "cuda:0\n", "")


def config_refusal(device: str) -> str | None:
    try:
        RunConfig(device=device)
    except ConfigError as e:
        return str(e)
    return None


def placement_refusal(device: str) -> str | None:
    """The placement's refusal of the device string itself (8 GPUs, 1 rank: any 'cuda:N' below 8 runs)."""
    try:
        plan_ranks(8, nproc=1, device=device)
    except PlanError as e:
        return str(e) if str(e).startswith("device must be") else None
    return None


@pytest.mark.parametrize("device", ACCEPTED + REFUSED)
def test_config_and_placement_accept_the_same_device_strings(device):
    assert config_refusal(device) == placement_refusal(device)
    assert (config_refusal(device) is None) == (device in ACCEPTED)


@pytest.mark.parametrize("device", ACCEPTED)
def test_every_accepted_device_is_one_torch_builds(device):
    if device != "auto":  # resolved by the course (a GPU if there is one), not a torch device
        torch.device(device)


# --- 3. the learning-rate schedule ------------------------------------------------------------------


def test_a_decay_that_ends_inside_the_warmup_is_refused_when_the_run_gets_there():
    """lr_decay_iters=50 < warmup_iters=100 over 200 steps: the warmup rises to ~learning_rate, then at
    iteration 100 get_lr is already past the decay and answers min_lr: a 10x drop in one step."""
    fields = dict(learning_rate=1e-3, min_lr=1e-4, warmup_iters=100, lr_decay_iters=50, max_iters=200, decay_lr=True)
    schedule = types.SimpleNamespace(**fields)  # the config get_lr would have run with
    assert get_lr(99, schedule) == pytest.approx(1e-3 * 100 / 101) and get_lr(100, schedule) == 1e-4
    with pytest.raises(ConfigError, match=r"lr_decay_iters \(50\) < warmup_iters \(100\).*iteration 100.*"
                                          r"set lr_decay_iters >= warmup_iters"):
        OptimizerConfig(**fields)
    with pytest.raises(ConfigError, match=r"lr_decay_iters \(4\) < warmup_iters \(100\)"):
        make_config("shakespeare_char_cpu", {"max_iters": 200, "lr_decay_iters": 4})


def test_schedules_that_never_reach_the_jump_stay_accepted():
    """The tests' and benchmarks' short runs (max_iters = lr_decay_iters = 4 .. 60 under the presets'
    warmup_iters = 100) end inside their warmup; no decay, or min_lr = learning_rate, has no jump."""
    short = make_config("shakespeare_char_cpu", {"max_iters": 60, "lr_decay_iters": 60})  # benchmarks/precision.py
    assert short.warmup_iters == 100
    OptimizerConfig(max_iters=100, warmup_iters=100, lr_decay_iters=4)  # the last step is iteration 99
    OptimizerConfig(max_iters=200, warmup_iters=100, lr_decay_iters=4, decay_lr=False)
    OptimizerConfig(max_iters=200, warmup_iters=100, lr_decay_iters=4, learning_rate=3e-3, min_lr=3e-3)
    for preset in TRAIN_PRESETS:
        make_config(preset)
    # resuming that short run past its warmup would reach the jump
    with pytest.raises(ConfigError, match="lr_decay_iters"):
        short.replace(max_iters=200)
