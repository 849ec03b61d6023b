"""An audit of the mixture of experts (gpt/moe.py, parallel/expert, analysis/moe_memory): each test
pins a bug found and fixed, against real gloo ranks where the bug was about a layout.

- The memory model's experts under tensor parallelism: ``rank_states`` divided every parameter by
  tp, but the course GPT keeps its routers and routed experts whole on every tp rank
  (parallel.expert.layer: "the experts are not split by tp"), so the launcher's memory estimate
  (launch.checks.estimate_bytes) under-counted them tp times for a tp x ep run.
- The capacity's rounding: ceil of a float product rounded 1.1 x 100 / 2 = 55 up to 56, one slot
  more than the rule, whenever the factor is a decimal that binary floating point cannot hold.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.analysis.moe_memory import PUBLISHED, MoEShape, rank_states
from course_lib.gpt.model import GPT, GPTConfig, make_adamw
from course_lib.gpt.moe import capacity
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.parallelize import parallelize
from course_lib.parallel.step import train_step

TINY = dict(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32, bias=True, n_expert=4, top_k=2)


def _tp2_rank(rank: int, world_size: int) -> dict:
    """One step of the tiny MoE GPT at tp = 2 (dp = ep = 1): what this rank holds."""
    torch.manual_seed(0)
    strategy = parallelize(GPT(GPTConfig(**TINY)), lambda m: make_adamw(m, 1e-3, weight_decay=0.0), "ddp", tp=2)
    x = torch.randint(0, TINY["vocab_size"], (1, 2, TINY["block_size"]), generator=torch.Generator().manual_seed(1))
    train_step(strategy, x, x)
    named = dict(strategy.module.named_parameters())
    return {"states": strategy.figures()["model_state_bytes"],
            "experts": sum(p.numel() for n, p in named.items() if ".mlp.experts." in n),
            "routers": sum(p.numel() for n, p in named.items() if ".mlp.router." in n)}


@pytest.mark.timeout(120)
def test_rank_states_keeps_the_course_experts_whole_on_every_tp_rank():
    """Each tp rank holds all the experts and routers of its ep shard (here ep = 1: all of them);
    the model must say so, and the whole rank's measured states within 5 % (as
    tests/test_moe_models.py holds the dp x ep layouts)."""
    shape = MoEShape.of_gpt(GPTConfig(**TINY))
    model = rank_states(shape, dp=1, ep=1, tp=2, dtype="fp32")  # fp32 Adam: 4 + 4 + 8 bytes
    for got in run_ranks(_tp2_rank, 2, timeout=60):
        assert got["experts"] == shape.expert_params() and got["routers"] == shape.params()["routers"]
        assert model.experts.params == 4 * got["experts"]
        assert got["states"] == pytest.approx(model.total.total, rel=0.05)
    # a published shape keeps the Megatron-LM reading: tp splits its experts as every matrix
    ds = PUBLISHED["deepseek-v3"]
    assert rank_states(ds, dp=8, ep=8, tp=2).experts.params == pytest.approx(
        rank_states(ds, dp=8, ep=8).experts.params / 2)


def test_capacity_is_the_rule_for_decimal_factors():
    """Fedus, Zoph and Shazeer, "Switch Transformers: Scaling to Trillion Parameter Models with Simple
    and Efficient Sparsity", JMLR 2022, Sec. 2.2, eq. 3: expert capacity = (tokens per batch /
    number of experts) x capacity factor (times k as GShard, Lepikhin et al. 2020, Sec. 2.2), rounded
    up only when it is not whole. 1.1 x 100 / 2 is 55 exactly; in floats 1.1 * 100 / 2 = 55.00000000000001."""
    assert capacity(100, 2, 1, 1.1) == 55
    assert capacity(100, 4, 2, 1.1) == 55  # k = 2: 1.1 x 2 x 100 / 4
    assert capacity(30, 4, 1, 1.25) == 10 and capacity(101, 2, 1, 1.1) == 56  # 55.55.. rounds up
    assert capacity(200, 8, 2, 1.2) == 60 and capacity(64, 4, 2, 1.0) == 32
