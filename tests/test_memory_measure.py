"""Measured memory and communication agree with the published formulas notebook 4 teaches.

Activations: Korthikanti et al. 2022 (arXiv:2205.05198), Sec. 4.1 and Table 2, through
course_lib.analysis.activations. Model states and communication: Rajbhandari et al. 2020 (ZeRO,
arXiv:1910.02054), Sec. 5 and 7: per rank (4 + 4 + 8) Psi in fp32 for DP, 4 + 4 + 8/N for stage 1,
4 + 12/N for stage 2, 16/N for stage 3; 2 Psi of traffic for DP and stages 1-2, 3 Psi for stage 3.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from course_lib.analysis.activations import activation_bytes
from course_lib.experiments.memory_measure import (
    CommCounter,
    compare_with_formulas,
    full_recomputation,
    measure_strategies,
    saved_activation_bytes,
)
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.launch.spawn import run_ranks

CFG = GPTConfig(block_size=32, vocab_size=65, n_layer=3, n_head=4, n_embd=64, bias=True)


def _batch(b: int):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, CFG.vocab_size, (b, CFG.block_size + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _formula(b: int, recompute: str = "none") -> float:
    # our GPT: fp32 (4-byte values), no dropout, fused attention (no s x s scores kept)
    return activation_bytes(CFG.n_layer, CFG.block_size, b, CFG.n_embd, CFG.n_head, CFG.vocab_size,
                            recompute=recompute, bytes_per_value=4, dropout=False,
                            flash_attention=True)


@pytest.mark.parametrize("b", [2, 8])
def test_saved_activations_match_korthikanti(b):
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = _batch(b)
    measured, loss = saved_activation_bytes(model, x, y)
    assert loss.requires_grad
    assert measured == pytest.approx(_formula(b), rel=0.02)
    with full_recomputation(model):
        kept, _ = saved_activation_bytes(model, x, y)
    assert kept == pytest.approx(_formula(b, "full"), rel=0.03)
    assert kept < measured / 5


@pytest.mark.parametrize("b", [2, 8])
def test_unfused_attention_without_dropout_keeps_its_scores_once(b):
    """SDPA's math kernel saves the softmax output once when there is no dropout (e a s^2 b per
    layer); the paper's 5 a s^2 b counts it twice, with the dropout's mask between."""
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = _batch(b)
    with sdpa_kernel(SDPBackend.MATH):
        measured, _ = saved_activation_bytes(model, x, y)
    unfused = activation_bytes(CFG.n_layer, CFG.block_size, b, CFG.n_embd, CFG.n_head, CFG.vocab_size,
                               bytes_per_value=4, dropout=False, flash_attention=False)
    assert measured == pytest.approx(unfused, rel=0.02)


def test_full_recomputation_gives_the_same_gradients_and_undoes_itself():
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = _batch(4)
    model(x, y)[1].backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with full_recomputation(model):
        model(x, y)[1].backward()
    for g, p in zip(plain, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    assert all("forward" not in vars(block) for block in model.transformer.h)
    assert saved_activation_bytes(model, x, y)[0] == pytest.approx(_formula(4), rel=0.02)


def _worker(rank, world_size):
    counter = CommCounter()
    t = torch.ones(1000)
    out = torch.empty(2000)
    with counter:
        dist.all_reduce(t)
        dist.all_gather_into_tensor(out, t)
    counted = (dict(counter.volume), dict(counter.calls))
    names = ["ddp", "zero1", "zero2", "zero3", "fsdp_full"]
    gpt = {"block_size": 16, "vocab_size": 65, "n_layer": 3, "n_head": 2, "n_embd": 32, "bias": True}
    return counted, measure_strategies(names, gpt, batch_size=2, steps=2, bucket_cap_mb=0.01)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_zero_stages_on_two_ranks_match_the_paper():
    results = run_ranks(_worker, 2)
    for rank, (counted, measured) in enumerate(results):
        assert counted == ({"all_reduce": 2 * 4000, "all_gather": 8000},
                           {"all_reduce": 1, "all_gather": 1})
        losses = [r["losses"] for r in measured.values()]
        for other in losses[1:]:  # every strategy is the same algorithm
            assert other == pytest.approx(losses[0], abs=1e-5)
        rows = {row["strategy"]: row for row in compare_with_formulas(measured, 2)}
        for name, row in rows.items():
            assert row["measured/formula"] == pytest.approx(1.0, abs=0.01), (rank, name, row)
        for name in ("ddp", "zero1", "zero2", "fsdp_full"):
            assert rows[name]["comm measured/formula"] == pytest.approx(1.0, abs=0.01), name
        # ours gathers the root unit (embeddings, final LayerNorm) once: 3 Psi - Psi_root
        assert 0.9 < rows["zero3"]["comm measured/formula"] <= 1.0
        ddp = rows["ddp"]["total MB"]
        assert [rows[n]["total MB"] < ddp for n in ("zero1", "zero2", "zero3")] == [True] * 3
        # stage 3 gathers one unit at a time: the peak is above the shards, below the whole model
        assert rows["zero3"]["params MB"] < rows["zero3"]["peak params MB"] < rows["ddp"]["params MB"]
