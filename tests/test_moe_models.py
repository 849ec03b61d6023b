"""The mixture-of-experts models against their sources and against real ranks.

Sources:
- DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437 (2024): abstract and Sec. 4.2,
  "671B total parameters, of which 37B are activated for each token".
- Jiang et al., "Mixtral of Experts", arXiv:2401.04088 (2024), Table 1 (the shape) and Sec. 1 ("47B
  parameters ... 13B active"); Mistral AI's release post (December 2023): 46.7B total, 12.9B per token.
- The ZeRO paper's bytes per parameter (analysis.memory), here split into experts and the rest.

The published totals are rounded (671B, 37B, 46.7B, 12.9B): the counts must agree to within 0.5 %
where the number has three digits or more, within 2 % for DeepSeek-V3's two-digit "37B" (the
paper does not say whether the token embedding, a look-up, counts as active: 37.55B with it,
36.63B without, both within 2 %).
"""

import pytest

from course_lib.analysis.memory import model_state_bytes
from course_lib.analysis.moe_memory import (
    PUBLISHED,
    MoEShape,
    gqa_attention_params,
    layout_rows,
    mla_attention_params,
    rank_states,
)


def test_deepseek_v3_totals_are_the_papers():
    ds = PUBLISHED["deepseek-v3"]
    assert ds.total_params() == pytest.approx(671e9, rel=0.005)
    assert ds.active_params() == pytest.approx(37e9, rel=0.02)
    assert ds.active_params(embeddings=False) == pytest.approx(37e9, rel=0.02)
    assert ds.n_moe_layers == 58
    # 97 % of the parameters are routed experts: what expert parallelism spreads over the ranks
    assert ds.expert_params() / ds.total_params() == pytest.approx(0.9745, abs=0.001)
    # one MLA layer, by hand: q down/up, kv down (+ rope key)/up, out, two RMSNorm gains
    mla = (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168)
    assert ds.attention_params == mla == 187_107_328


def test_mixtral_totals_are_the_papers():
    mx = PUBLISHED["mixtral-8x7b"]
    assert mx.total_params() == pytest.approx(46.7e9, rel=0.005)
    assert mx.active_params() == pytest.approx(12.9e9, rel=0.005)
    assert mx.total_params() == pytest.approx(47e9, rel=0.01)  # the paper's own rounding
    assert mx.active_params() == pytest.approx(13e9, rel=0.01)
    # grouped-query attention: K and V have 8 heads of 128, Q and the output 32
    assert mx.attention_params == 4096 * (4096 + 2 * 1024) + 4096 * 4096
    # "8x7B" is not 56B: only the feed-forward networks are repeated
    expert = 3 * 4096 * 14336
    assert mx.params()["experts"] == 32 * 8 * expert


def test_gpt_shaped_moe_counts_like_the_dense_gpt():
    """One expert of GPT's MLP with top-1 is the dense GPT plus a router of h weights a layer."""
    h, L, V, T = 64, 2, 65, 32
    one = MoEShape("tiny", L, h, V, gqa_attention_params(h, 4, bias=True), n_experts=1, top_k=1,
                   expert_hidden=4 * h, ffn_matrices=2, ffn_bias=True, norm_bias=True,
                   tied_embeddings=True, positions=T)
    dense_gpt = (V + T) * h + L * (12 * h * h + 13 * h) + 2 * h  # analysis.memory.ModelShape's count
    assert one.total_params() == dense_gpt + L * h
    assert one.active_params() == one.total_params()


def test_rank_states_split_experts_over_ep_and_the_rest_over_dp():
    ds = PUBLISHED["deepseek-v3"]
    parts = ds.params()
    experts, rest = parts["experts"], ds.total_params() - parts["experts"]
    for dp, ep, stage in ((1, 1, 0), (8, 8, 0), (32, 8, 1), (128, 64, 3)):
        r = rank_states(ds, dp=dp, ep=ep, stage=stage)
        assert r.experts == model_state_bytes(experts / ep, dp // ep, stage)  # expert data parallel: dp / ep
        assert r.non_experts == model_state_bytes(rest, dp, stage)
        assert r.total.total == pytest.approx(r.experts.total + r.non_experts.total)
    # summed over the ep ranks of one group with no ZeRO, the experts are held exactly once
    assert 8 * rank_states(ds, dp=8, ep=8).experts.params == pytest.approx(2 * experts)
    # the experts may keep another stage than the rest (ZeRO on the non-expert parameters only)
    r = rank_states(ds, dp=32, ep=8, stage=3, expert_stage=0)
    assert r.experts == model_state_bytes(experts / 8, 4, 0)
    # DeepSeek-V3's layout (Sec. 3.2): pp 16, ep 64 within dp 128, ZeRO-1: 2048 GPUs
    r = rank_states(ds, dp=128, ep=64, pp=16, stage=1)
    assert r.total.params == pytest.approx(2 * (experts / (64 * 16) + rest / 16))  # 2-byte weights
    assert r.total.optimizer == pytest.approx(12 * (experts / (64 * 16 * 2) + rest / (16 * 128)))
    row = layout_rows(ds, [{"dp": 128, "ep": 64, "pp": 16, "stage": 1}])[0]
    assert row["GPUs"] == 2048 and row["total GB"] == pytest.approx(r.total.total / 1e9)
    with pytest.raises(ValueError, match="split evenly"):
        rank_states(ds, dp=3, ep=3)
    with pytest.raises(ValueError, match="must divide dp"):
        rank_states(ds, dp=4, ep=8)
    with pytest.raises(ValueError, match="top_k"):
        MoEShape("bad", 1, 8, 8, 0, n_experts=2, top_k=3, expert_hidden=8)


def test_mla_counts_its_projections():
    assert mla_attention_params(8, 2, 4, 3, 2, 1, 2) == (8 * 4 + 4 + 4 * 2 * 3) + (8 * 4 + 3 + 3 * 2 * 4) + 2 * 2 * 8
