"""The strategy decision guide (notebook 5) follows images/diagrams/strategy_guide.mmd, and its
"fits" answers are the ZeRO paper's per-device model states (Rajbhandari et al. 2020, Sec. 5:
16 Psi for DP, 16 Psi / N for ZeRO-3, mixed-precision Adam) plus activations from
course_lib.analysis.memory."""

from __future__ import annotations

import pytest

from course_lib.analysis.memory import GB, breakdown
from course_lib.analysis.strategy_guide import RECOMMENDATIONS, choose_strategy, scenarios


def test_one_gpu():
    small = choose_strategy("gpt2", 1, gpu="t4")
    assert small.strategy == "single"
    assert small.totals_gb["one GPU, plain DP (GB)"] == pytest.approx(
        breakdown(preset="gpt2", flash_attention=True).total / GB)
    big = choose_strategy("gpt2-xl", 1, gpu="t4")
    assert big.strategy == "single_memory"
    assert any("activations" in n for n in big.notes)  # they dominate: recompute first


def test_fits_on_one_gpu_means_data_parallel():
    a = choose_strategy("gpt2-medium", 8, gpu="a100-40gb")
    assert (a.strategy, a.degrees) == ("ddp", {"dp": 8})
    multi = choose_strategy("gpt2-medium", 16, gpus_per_node=8, gpu="a100-40gb")
    assert multi.strategy == "ddp" and any("accumulate" in n for n in multi.notes)


def test_zero3_when_the_shards_fit():
    a = choose_strategy(7.5e9, 8, gpu="a100-80gb")  # 16 x 7.5e9 = 120 GB; / 8 = 15 GB
    assert a.strategy == "zero3"
    assert a.totals_gb == pytest.approx({"one GPU, plain DP (GB)": 120.0, "ZeRO-3 over 8 GPUs (GB)": 15.0})
    assert any("bare parameter count" in n for n in a.notes)
    # 70 B on 64 H100 with a fast network: 16 x 70 / 64 = 17.5 GB per GPU
    fast = choose_strategy(70e9, 64, gpus_per_node=8, gpu="h100")
    assert fast.strategy == "zero3" and fast.totals_gb["ZeRO-3 over 64 GPUs (GB)"] == pytest.approx(17.5)


def test_slow_network_splits_the_model_inside_nodes():
    a = choose_strategy(70e9, 64, gpus_per_node=8, gpu="h100", fast_internode=False)
    assert a.totals_gb["ZeRO-3 over 8 GPUs (GB)"] == pytest.approx(140.0)  # sharded in one node only
    assert (a.strategy, a.degrees) == ("tp", {"tp": 8, "pp": 1, "dp": 8})
    # tp = 8: 2 + 2 bytes of weights and gradients over 8, 12 bytes of Adam over 8 x 8 (ZeRO-1)
    assert a.totals_gb["TP 8 x PP 1, ZeRO-1 over the rest (GB)"] == pytest.approx(4 * 70 / 8 + 12 * 70 / 64)
    # 200 B: tp 8 alone leaves 4 x 200 / 8 + 12 x 200 / 64 = 137.5 GB; 4 pipeline stages divide
    # the states by 4 (ZeRO-1 over the 2 replicas left): (100 + 12 x 200 / 16) / 4 = 62.5 GB
    huge = choose_strategy(200e9, 64, gpus_per_node=8, gpu="h100", fast_internode=False)
    assert (huge.strategy, huge.degrees) == ("tp_pp", {"tp": 8, "pp": 4, "dp": 2})
    assert huge.totals_gb["TP 8 x PP 4, ZeRO-1 over the rest (GB)"] == pytest.approx(62.5)
    assert choose_strategy(1e12, 64, gpus_per_node=8, gpu="h100").strategy == "does_not_fit"


def test_recomputation_changes_the_answer():
    assert choose_strategy("gpt2-xl", 4, gpu="t4").strategy == "does_not_fit"
    assert choose_strategy("gpt2-xl", 4, gpu="t4", recompute="full").strategy == "zero3"


def test_scenarios_run_and_print():
    for title, kwargs in scenarios():
        advice = choose_strategy(**kwargs)
        assert advice.strategy in RECOMMENDATIONS
        assert RECOMMENDATIONS[advice.strategy] in str(advice) and "<ol>" in advice._repr_html_()


def test_bad_input():
    with pytest.raises(ValueError, match="n_gpus"):
        choose_strategy("gpt2", 0)
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        choose_strategy("gpt2", 12, gpus_per_node=8)
    with pytest.raises(ValueError, match="unknown GPU"):
        choose_strategy("gpt2", 2, gpu="gtx480")
    with pytest.raises(ValueError, match="unknown model preset"):
        choose_strategy("gpt9", 2)
