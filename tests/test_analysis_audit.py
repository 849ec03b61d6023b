"""Audit of course_lib.analysis: layouts the planners propose must be ones the trainer can run
(course_lib.registry.layout_error is the trainer's rule book), and the closed-form models refuse
the layouts they cannot describe instead of answering for another one."""

from __future__ import annotations

import pytest

from course_lib.analysis.layout_plan import plan_layouts
from course_lib.analysis.memory import get_preset
from course_lib.analysis.parallel_comm import sent_bytes_per_step
from course_lib.analysis.strategy_guide import choose_strategy


def test_strategy_guide_tp_divides_the_node():
    """Tensor parallel inside each node: tp must divide both the heads (Shoeybi et al. 2019,
    "Megatron-LM", Sec. 3: attention splits by heads) and the GPUs of a node, so that every tp
    group sits in one node and tp x pp x dp uses every GPU (Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Sec. 3: t x p x d = n).

    GPT-2 large has 20 heads: on nodes of 8 GPUs the largest tp dividing both is 4. The guide used
    to pick tp = 5 (the largest divisor of 20 up to 8): 5 x 1 x 3 = 15 of the 16 GPUs, with the tp
    groups of ranks 5-9 and 10-14 straddling the two nodes."""
    a = choose_strategy("gpt2-large", n_gpus=16, gpus_per_node=8, gpu="t4", fast_internode=False)
    assert (a.strategy, a.degrees) == ("tp", {"tp": 4, "pp": 1, "dp": 4})
    # GPT-2 XL's 25 heads share no factor with 8: tp = 1, and whatever the guide answers uses 16 GPUs
    xl = choose_strategy("gpt2-xl", n_gpus=16, gpus_per_node=8, gpu="t4", fast_internode=False)
    assert "tensor parallel 1 in the node" in str(xl)
    assert not xl.degrees or xl.degrees["tp"] * xl.degrees["pp"] * xl.degrees["dp"] == 16


def test_plan_layouts_sequence_parallel_splits_the_sequence_evenly():
    """Sequence parallelism splits each cp rank's s/cp tokens over the tp ranks (Korthikanti et
    al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.2.2), so tp
    must divide s/cp; the trainer refuses the layout otherwise (registry.layout_error).

    shakespeare_char: 6 heads, 256 tokens. tp = 3 or 6 splits the heads but not the 256 tokens:
    with sequence_parallel=True (the default) such layouts were listed, and ranked as fitting."""
    s = get_preset("shakespeare_char").block_size
    rows = plan_layouts("shakespeare_char", n_nodes=1, gpus_per_node=6, gpu="a100-80gb", global_batch=60)
    assert rows and all((s // r["cp"]) % r["tp"] == 0 for r in rows)
    # without sequence parallelism only the heads need to divide: tp = 3 and 6 stay
    no_sp = plan_layouts("shakespeare_char", n_nodes=1, gpus_per_node=6, gpu="a100-80gb", global_batch=60,
                         sequence_parallel=False)
    assert {r["tp"] for r in no_sp} == {1, 2, 3, 6}


SMALL = dict(n_embd=64, vocab_size=65, block_size=32, bias=True, batch_size=2, micro_batches=1)


def test_sent_bytes_refuses_layouts_it_cannot_describe():
    """Each pipeline stage holds n_layer / pp blocks (Narayanan et al. 2021, Sec. 2.2; the trainer
    refuses n_layer % pp != 0). 5 layers on 2 stages used to be counted as 2 layers a stage, the
    same bytes as 4 layers, and a pp_rank outside 0..pp-1 as a middle stage."""
    assert sent_bytes_per_step(n_layer=4, pp=2, tp=2, **SMALL)["pp"] > 0
    with pytest.raises(ValueError, match="n_layer"):
        sent_bytes_per_step(n_layer=5, pp=2, tp=2, **SMALL)
    with pytest.raises(ValueError, match="pp_rank"):
        sent_bytes_per_step(n_layer=4, pp=2, pp_rank=2, **SMALL)


def test_plan_layouts_on_a_gpu_without_bf16_uses_its_fp16_peak():
    """A T4 (Colab's GPU) has no bf16 peak: plan_layouts divided by None (TypeError). It trains in
    fp16 (NVIDIA T4 data sheet, 2019: 65 TFLOP/s fp16 tensor), as the profile says."""
    t4 = plan_layouts("gpt2", n_nodes=1, gpus_per_node=4, gpu="t4", global_batch=8)
    a100 = plan_layouts("gpt2", n_nodes=1, gpus_per_node=4, gpu="a100-80gb", global_batch=8)
    assert t4 and a100
    def compute_s(r):  # step_s = compute_s / (1 - bubble) + comm_s
        return (r["step_s"] - r["comm_s"]) * (1 - r["bubble"])

    same = {r["layout"]: r for r in a100}
    for r in t4:  # the compute part scales with the peaks: 312 / 65
        assert compute_s(r) == pytest.approx(compute_s(same[r["layout"]]) * 312 / 65)
