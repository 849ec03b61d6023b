"""Audit of the frameworks lesson's library (notebook 11) against what the frameworks do.

Each test once failed:
- ``make_fabric("single")`` on one of several ranks built Fabric's SingleDeviceStrategy on every
  rank: each rank trained its own model on its share of the batch, no gradient exchanged, and
  ``train_qa`` reported the mean of their losses as if it were one program (its second loss on 2
  ranks differed from one rank's) without a word;
- ``make_fabric`` dropped the arguments its strategy does not use: ``parallelize`` under "ddp"
  (a student's FSDP2 ``parallelize_fn`` never ran, DDP trained instead), ``bucket_cap_mb`` under
  "fsdp2", and ``devices`` other than the ranks there are under "ddp";
- ``fabric_step`` took ``out[1]`` of any tuple for the course GPT's loss: a Hugging Face model
  called with ``return_dict=False`` returns (loss, start_logits, end_logits), so the step trained
  on the mean of the start logits, and reported it as the loss.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.launch.spawn import RankError, run_ranks

pytest.importorskip("lightning", reason="the frameworks extra: pip install 'course-lib[frameworks]'")
pytest.importorskip("transformers", reason="the frameworks extra: pip install 'course-lib[frameworks]'")

from course_lib.experiments.frameworks_fabric import fabric_setup, fabric_step, fsdp2_parallelize, make_fabric
from course_lib.experiments.frameworks_qa import BERT_TINY, KEYS, bert_qa, qa_examples, train_qa


@pytest.mark.timeout(120)
def test_single_on_several_ranks_is_an_error_not_two_separate_trainings():
    # one rank is the program; "single" on 2 ranks used to train two unsynchronised models
    with pytest.raises(RankError, match="single"):
        run_ranks(train_qa, 2, "single", BERT_TINY, 2, 8, timeout=60)
    # on one rank it still runs, and it trains
    one = run_ranks(train_qa, 1, "single", BERT_TINY, 2, 8, timeout=60)[0]
    assert len(one["losses"]) == 2


def _ask_for_dropped_arguments(rank, world):
    """On every rank: what make_fabric does with an argument its strategy would not use."""
    asked = {"parallelize under ddp": ("ddp", {"parallelize": fsdp2_parallelize()}),
             "bucket_cap_mb under fsdp2": ("fsdp2", {"bucket_cap_mb": 1}),
             "devices=4 on 2 ddp ranks": ("ddp", {"devices": 4})}
    out = {}
    for label, (strategy, kwargs) in asked.items():
        try:
            fabric = make_fabric(strategy, **kwargs)
            out[label] = f"built {type(fabric.strategy).__name__} on {fabric.world_size} ranks"
        except (ValueError, TypeError) as e:
            out[label] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.timeout(120)
def test_make_fabric_refuses_arguments_its_strategy_would_drop():
    said = run_ranks(_ask_for_dropped_arguments, 2, timeout=60)[0]
    assert said["parallelize under ddp"].startswith("ValueError") and "fsdp2" in said["parallelize under ddp"]
    assert said["bucket_cap_mb under fsdp2"].startswith("TypeError") and "bucket_cap_mb" in said["bucket_cap_mb under fsdp2"]
    assert said["devices=4 on 2 ddp ranks"].startswith("ValueError") and "2 ranks" in said["devices=4 on 2 ddp ranks"]
    # what the lesson and exercise 07 ask for still builds
    built = run_ranks(lambda rank, world: (type(make_fabric("ddp", bucket_cap_mb=0.05)).__name__,
                                           type(make_fabric("fsdp2", parallelize=fsdp2_parallelize()).strategy).__name__),
                      2, timeout=60)[0]
    assert built == ("Fabric", "ModelParallelStrategy")


def _step_on_tuple_output(rank, world):
    """A Hugging Face model called with return_dict=False: a tuple (loss, start_logits, end_logits)."""
    data = qa_examples(4, max_len=32, vocab_size=100)
    torch.manual_seed(0)
    fabric = make_fabric("ddp")
    model, opt = fabric_setup(fabric, bert_qa(BERT_TINY, len(data["vocab"]), 32),
                              lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    batch = {k: data[k][2 * rank:2 * rank + 2] for k in KEYS}
    before = [p.detach().clone() for p in model.parameters()]
    try:
        loss = fabric_step(fabric, model, opt, **batch, return_dict=False)
        said = f"stepped on {loss.item():.4f}"
    except ValueError as e:
        said = f"ValueError: {e}"
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return said, moved


@pytest.mark.timeout(120)
def test_a_step_never_trains_on_logits_taken_for_the_loss():
    # out[1] of HF's tuple is start_logits (2, 32): the step used to train on their mean
    said, moved = run_ranks(_step_on_tuple_output, 2, timeout=60)[0]
    assert said.startswith("ValueError") and "return_dict" in said, said
    assert not moved  # refused before fabric.backward and the optimizer's step


def test_deepspeed_sets_the_model_and_its_optimizer_up_together():
    """fabric_setup called setup_module, then setup_optimizers, which Lightning refuses for DeepSpeed
    ("requires the model and optimizer(s) to be set up jointly", ``Fabric._validate_setup_optimizers``):
    lesson 11's deepspeed would have failed there on a GPU machine. DeepSpeed is not installed here,
    so the strategy is one made without its __init__ (which needs deepspeed), on a recording Fabric."""
    from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy  # after importorskip above

    class Recorder:
        def __init__(self, strategy):
            self.strategy, self.calls = strategy, []

        def setup(self, model, optimizer):
            self.calls.append("setup")
            return model, optimizer

        def setup_module(self, model):
            self.calls.append("setup_module")
            return model

        def setup_optimizers(self, optimizer):
            self.calls.append("setup_optimizers")
            return optimizer

    model = torch.nn.Linear(2, 2)
    for strategy, calls in ((DeepSpeedStrategy.__new__(DeepSpeedStrategy), ["setup"]),
                            (DDPStrategy.__new__(DDPStrategy), ["setup_module", "setup_optimizers"])):
        fabric = Recorder(strategy)
        module, optimizer = fabric_setup(fabric, model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
        assert fabric.calls == calls and module is model
        assert optimizer.param_groups[0]["params"] == list(model.parameters())
