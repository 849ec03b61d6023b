"""The memory model against its sources and against tensors PyTorch really holds.

Sources:
- ZeRO: Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", SC 2020, arXiv:1910.02054. Figure 1 and Section 5.1-5.3 (the 7.5B example),
  Table 1 in Section 5 (per-device memory by DP degree), Section 3.1 (K = 12 for mixed-precision
  Adam).
- Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
  arXiv:2205.05198: Eq. 1 and Section 4.1 (per-layer counts), Table 2 (per-layer activation memory
  with tensor/sequence parallelism and recomputation), Section 4.3 (outside the layers), Table 3
  (model configurations), abstract ("reduces activation memory by 5x").
"""

import json
import math
import subprocess
import sys

import pytest
import torch

from course_lib.analysis import memory_cli
from course_lib.analysis.activations import (
    activation_bytes,
    activation_bytes_outside_layers,
    activation_bytes_per_layer,
)
from course_lib.analysis.memory import (
    GB,
    PRESETS,
    ModelShape,
    breakdown,
    fits,
    max_params,
    model_state_bytes,
    shard_numel,
    zero_stages,
)
from course_lib.hardware import GiB

# ZeRO paper, Table 1 ("Per-device memory consumption of different optimizations in ZeRO-DP as a
# function of DP degree"), as printed: GB per device for P_os, P_os+g, P_os+g+p.
TABLE1_DP = (1, 4, 16, 64, 256, 1024)
TABLE1 = {
    7.5e9: {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
            64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"),
            1024: ("30.1", "15.1", "0.12")},
    128e9: {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
            64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513", "257", "2")},
    1e12: {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"),
           16: ("4750", "2875", "1000"), 64: ("4187", "2218", "250"),
           256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6")},
}
# Bold cells of Table 1: the smallest DP degree at which each model fits a 32 GB V100.
TABLE1_BOLD = {(7.5e9, 1): 64, (7.5e9, 2): 16, (7.5e9, 3): 4, (128e9, 1): None, (128e9, 2): None,
               (128e9, 3): 64, (1e12, 1): None, (1e12, 2): None, (1e12, 3): 1024}


def printed_as(value: float, printed: str) -> bool:
    """Whether ``value`` prints as ``printed`` when rounded (half up) or truncated to its digits.

    The paper rounds the 7.5B column to three significant figures (41.25 -> 41.3) and truncates
    the larger ones to whole numbers (4187.5 -> 4187, 513.5 -> 513, 257.75 -> 257).
    """
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    unit = 10.0 ** -decimals
    diff = value - float(printed)
    return -unit / 2 - 1e-9 <= diff < unit + 1e-9


def test_figure1_example_7_5b_on_64_gpus():
    # Figure 1 / Sections 5.1-5.3: Psi = 7.5B, N_d = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
    gb = {s: m.total / GB for s, m in zero_stages(7.5e9, dp=64).items()}
    assert gb[0] == pytest.approx(120.0)
    assert gb[1] == pytest.approx(31.40625) and round(gb[1], 1) == 31.4
    assert gb[2] == pytest.approx(16.640625) and round(gb[2], 1) == 16.6
    assert gb[3] == pytest.approx(1.875) and printed_as(gb[3], "1.88")
    # The paper's GB is 1e9 bytes: in GiB the baseline would print as 111.8, not 120.
    assert zero_stages(7.5e9)[0].total / GiB == pytest.approx(111.76, abs=0.01)


@pytest.mark.parametrize("psi", sorted(TABLE1))
def test_table1_every_cell(psi):
    checked = 0
    for dp in TABLE1_DP:
        stages = zero_stages(psi, dp=dp)
        for stage, printed in zip((1, 2, 3), TABLE1[psi][dp]):
            value = stages[stage].total / GB
            assert printed_as(value, printed), (psi, dp, stage, value, printed)
            checked += 1
    assert checked == 18


def test_table1_bold_cells_are_the_smallest_dp_that_fits_a_32gb_v100():
    # Table 1 caption: bold = combinations that fit a cluster of 32GB V100 GPUs (the first DP
    # degree that does, in each column). The V100 profile comes from course_lib.hardware.
    for (psi, stage), expected in TABLE1_BOLD.items():
        first = next((dp for dp in TABLE1_DP
                      if fits(model_state_bytes(psi, dp, stage).total, "v100")), None)
        assert first == expected, (psi, stage)


def test_stage_formulas_in_terms_of_k():
    # Section 5: (2+2+K)Psi, 2Psi + 2Psi + K Psi/N, 2Psi + (2+K)Psi/N, (2+2+K)Psi/N.
    psi, n = 3.3e9, 12
    for k in (0, 4, 12, 16):
        s = zero_stages(psi, dp=n, k=k)
        assert s[0].total == pytest.approx((4 + k) * psi)
        assert s[1].total == pytest.approx(4 * psi + k * psi / n)
        assert s[2].total == pytest.approx(2 * psi + (2 + k) * psi / n)
        assert s[3].total == pytest.approx((4 + k) * psi / n)
        assert (s[1].params, s[1].grads) == (2 * psi, 2 * psi)
    # Section 5.1/5.2: P_os cuts memory 4x and P_os+g 8x for large N_d; P_os+g+p by N_d.
    big = zero_stages(1e9, dp=10**6)
    assert big[0].total / big[1].total == pytest.approx(4, rel=1e-4)
    assert big[0].total / big[2].total == pytest.approx(8, rel=1e-4)
    assert zero_stages(1e9, dp=64)[0].total / zero_stages(1e9, dp=64)[3].total == pytest.approx(64)


def test_fp32_training_and_tensor_parallel():
    s = zero_stages(1e9, dp=8, dtype="fp32")
    assert (s[0].params, s[0].grads, s[0].optimizer) == (4e9, 4e9, 8e9)
    assert s[1].total == pytest.approx(8e9 + 8e9 / 8)
    assert s[3].total == pytest.approx(16e9 / 8)
    assert model_state_bytes(1e9, dp=4, stage=2, tp=2).total == pytest.approx(
        model_state_bytes(0.5e9, dp=4, stage=2).total)
    assert max_params(32e9) == pytest.approx(2e9)  # 16 bytes per parameter
    assert shard_numel(10, 4) == 3 and shard_numel(8, 4) == 2


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match=r"stage must be 0 \(plain DP\), 1, 2 or 3"):
        model_state_bytes(1e9, dp=2, stage=4)
    with pytest.raises(ValueError, match="dp"):
        model_state_bytes(1e9, dp=0)
    with pytest.raises(ValueError, match="dp"):
        model_state_bytes(1e9, dp=2.5)
    with pytest.raises(ValueError, match="num_params"):
        model_state_bytes(-1, dp=2)
    with pytest.raises(ValueError, match="dtype must be one of"):
        model_state_bytes(1e9, dtype="int8")
    with pytest.raises(ValueError, match="unknown GPU 'k80'.*t4"):
        fits(1, "k80")
    with pytest.raises(ValueError, match="unknown model preset"):
        breakdown(preset="gpt5")
    with pytest.raises(ValueError, match="divisible by tp"):
        activation_bytes_per_layer(1024, 1, 768, 12, t=5)
    with pytest.raises(ValueError, match="recompute must be one of"):
        activation_bytes_per_layer(1024, 1, 768, 12, recompute="some")
    with pytest.raises(ValueError, match="exceeds"):
        breakdown(preset="gpt2", seq_len=2048)


def table2(s, b, h, a, t, row):
    """Korthikanti et al. 2022, Table 2, typed in from the paper."""
    return {
        "none": s * b * h * (34 + 5 * a * s / h),
        "tp": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp+sp": s * b * h / t * (34 + 5 * a * s / h),
        "tp+selective": s * b * h * (10 + 24 / t),
        "tp+sp+selective": s * b * h * 34 / t,
        "full": 2 * s * b * h,
    }[row]


@pytest.mark.parametrize("s,b,h,a,t", [(2048, 1, 12288, 96, 8), (1024, 12, 768, 12, 1),
                                       (256, 64, 384, 6, 2), (2048, 4, 6144, 64, 4)])
def test_activation_per_layer_matches_table2(s, b, h, a, t):
    f = activation_bytes_per_layer
    assert f(s, b, h, a, 1) == pytest.approx(table2(s, b, h, a, 1, "none"))
    assert f(s, b, h, a, t) == pytest.approx(table2(s, b, h, a, t, "tp"))
    assert f(s, b, h, a, t, sequence_parallel=True) == pytest.approx(table2(s, b, h, a, t, "tp+sp"))
    assert f(s, b, h, a, t, recompute="selective") == pytest.approx(
        table2(s, b, h, a, t, "tp+selective"))
    assert f(s, b, h, a, t, True, "selective") == pytest.approx(
        table2(s, b, h, a, t, "tp+sp+selective"))
    assert f(s, b, h, a, t, recompute="full") == pytest.approx(table2(s, b, h, a, t, "full"))
    # Eq. 1 split: attention 11sbh + 5as^2b, MLP 19sbh, LayerNorm 4sbh.
    assert f(s, b, h, a, 1) == pytest.approx((11 + 19 + 4) * s * b * h + 5 * a * s * s * b)


def test_outside_layers_section_4_3():
    s, b, h, v, t, L = 2048, 1, 12288, 51200, 8, 96
    # the paper's terms, counted under sequence parallelism ("also parallelized along the sequence
    # dimension", "also uses sequence parallelism"): sbh/t (p + 4 (1 + v/h)), p = 1
    paper = s * b * h * L / t * (1 / L + 4 / L * (1 + v / h))
    assert activation_bytes_outside_layers(s, b, h, v, t, sequence_parallel=True) == pytest.approx(paper)
    total = activation_bytes(L, s, b, h, 96, v, t, sequence_parallel=True)
    assert total == pytest.approx(s * b * h * L / t * (34 + 5 * 96 * s / h) + paper)
    # without it the dropout mask and the two 2-byte inputs are whole on every rank; the fp32 logits
    # of a vocabulary-parallel output layer are still split
    assert activation_bytes_outside_layers(s, b, h, v, t) == pytest.approx(5 * s * b * h + 4 * s * b * v / t)


def test_without_dropout_the_scores_are_kept_once():
    """The paper's 5 a s^2 b is the softmax output (2), its dropout mask (1) and the dropout's
    output (2); without dropout the softmax output is the attention's input, kept once: 2 a s^2 b
    (and e a s^2 b in fp32, what autograd saves: tests/test_memory_measure.py measures it)."""
    s, b, h, a = 1024, 2, 768, 12
    with_dropout = activation_bytes_per_layer(s, b, h, a)
    without = activation_bytes_per_layer(s, b, h, a, dropout=False)
    assert with_dropout == pytest.approx(s * b * h * 34 + 5 * a * s * s * b)
    assert without == pytest.approx(s * b * h * 32 + 2 * a * s * s * b)


# Korthikanti et al. 2022, Table 3: (heads a, hidden h, layers L, tensor-parallel t), s = 2048.
KORTHIKANTI_MODELS = {"22B": (64, 6144, 48, 8), "175B": (96, 12288, 96, 8),
                      "530B": (128, 20480, 105, 8), "1T": (160, 25600, 128, 8)}


def test_sequence_parallel_and_selective_recompute_save_about_5x():
    for name, (a, h, _, t) in KORTHIKANTI_MODELS.items():
        baseline = activation_bytes_per_layer(2048, 1, h, a, t)  # tensor parallel only
        ours = activation_bytes_per_layer(2048, 1, h, a, t, True, "selective")
        assert 4.5 < baseline / ours < 6.5, name  # abstract: "reduces activation memory by 5x"
        # Section 5: for large models 5as/h > 34, so selective recompute drops over half.
        assert 5 * a * 2048 / h > 34
        no_par = activation_bytes_per_layer(2048, 1, h, a)
        assert activation_bytes_per_layer(2048, 1, h, a, recompute="selective") < no_par / 2


def test_gpt2_presets_parameter_counts():
    # Parameter counts of the released GPT-2 checkpoints (tied lm_head); the lesson's table
    # names them 124M, 350M, 774M, 1558M.
    expected = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
                "gpt2-xl": 1_557_611_200}
    for name, n in expected.items():
        assert PRESETS[name].num_params() == n
    assert [round(PRESETS[n].num_params() / 1e6) for n in ("gpt2", "gpt2-large", "gpt2-xl")] == [
        124, 774, 1558]
    assert PRESETS["gpt2-medium"].num_params() == pytest.approx(350e6, rel=0.02)


def test_preset_counts_equal_the_course_model():
    from course_lib.gpt.model import GPT, GPTConfig

    shapes = list(PRESETS.values()) + [ModelShape("nobias", 3, 2, 64, 32, 100, 1, bias=False)]
    for shape in shapes:
        with torch.device("meta"):
            model = GPT(GPTConfig.from_shape(shape))
        assert model.num_params() == shape.num_params(), shape.name


def _saved_activation_bytes(model, idx, targets) -> int:
    """Bytes of the distinct tensors autograd saves for backward, parameters excluded."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, targets)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in saved.items() if ptr not in params)


def test_activations_match_what_autograd_saves():
    """fp32, no dropout, fused attention (the course model's SDPA): the Korthikanti count with
    e = 4, no masks and no s x s scores is within 2% of the bytes autograd really keeps (the
    rest: LayerNorm statistics and the attention log-sum-exp, which the paper neglects)."""
    from course_lib.gpt.model import GPT, GPTConfig

    shape = PRESETS["shakespeare_char_cpu"]
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_shape(shape)).train()  # dropout 0 in this preset
    b = 8
    idx = torch.randint(0, shape.vocab_size, (b, shape.block_size))
    measured = _saved_activation_bytes(model, idx, torch.roll(idx, -1, 1))
    m = breakdown(preset=shape, batch_size=b, dtype="fp32", flash_attention=True)
    assert 1.0 <= measured / m.activations < 1.02


def test_model_states_match_a_real_adamw_step():
    """fp32 AdamW holds weights, gradients and two moments: 4 + 4 + 8 = 16 bytes per parameter."""
    from course_lib.gpt.model import GPT, GPTConfig

    shape = PRESETS["shakespeare_char_cpu"]
    model = GPT(GPTConfig.from_shape(shape))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, shape.vocab_size, (2, shape.block_size))
    model(idx, idx)[1].backward()
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    params = list(model.parameters())
    states = [v for p in params for k, v in opt.state[p].items() if k in ("exp_avg", "exp_avg_sq")]
    m = model_state_bytes(shape.num_params(), dtype="fp32")
    assert (nbytes(params), nbytes(p.grad for p in params), nbytes(states)) == (
        m.params, m.grads, m.optimizer)


def test_breakdown_and_fits_on_a_t4():
    xl = breakdown(preset="gpt2-xl")  # 1.56B x 16 bytes = 24.9 GB of states alone
    assert xl.model_states == pytest.approx(16 * 1_557_611_200)
    assert not xl.fits("t4")
    small = breakdown(preset="gpt2-xl", dp=8, stage=3, batch_size=1, recompute="full",
                      flash_attention=True)
    assert small.fits("t4") and small.total < 16e9
    gb = small.to_gb()
    assert gb["total"] == pytest.approx(sum(gb[k] for k in ("params", "grads", "optimizer",
                                                             "activations")))
    assert breakdown(7.5e9, dp=64, stage=1).to_gb()["total"] == pytest.approx(31.40625)
    assert breakdown(7.5e9).activations == 0.0
    tiny = breakdown(preset="shakespeare_char_cpu")
    assert tiny.fits(16e9) and tiny.num_params == PRESETS["shakespeare_char_cpu"].num_params()


def test_cli_json_and_table(capsys):
    assert memory_cli.cli(["--params", "7.5e9", "--dp", "64", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    totals = [r["total"] for r in rep["stages"]]
    assert totals == pytest.approx([120e9, 31.40625e9, 16.640625e9, 1.875e9])
    assert rep["unit"] == "bytes" and rep["dp"] == 64 and rep["k"] == 12
    assert memory_cli.cli(["--preset", "gpt2-xl", "--gpu", "t4", "--stage", "0", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "fits t4" in out and "ZeRO-3" in out and "ZeRO-1" not in out
    # torch.autocast's layout (the trainer's --dtype=bfloat16): 16 bytes per parameter, K = 8
    assert memory_cli.cli(["--preset", "gpt2", "--dtype", "autocast", "--recompute", "full", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    psi = rep["num_params"]
    assert rep["k"] == 8 and rep["stages"][0]["model_states"] == pytest.approx(16 * psi)
    assert rep["stages"][0]["activations"] == pytest.approx(
        breakdown(preset="gpt2", dtype="autocast", recompute="full").activations)
    with pytest.raises(SystemExit) as e:
        memory_cli.cli(["--params", "1e9", "--stage", "4"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        memory_cli.cli(["--dp", "4"])
    assert "give --params" in capsys.readouterr().err


def test_course_memory_entry_point():
    out = subprocess.run([sys.executable, "-m", "course_lib.cli", "memory", "--params", "7.5e9",
                          "--dp", "64", "--json"], capture_output=True, text=True, check=True)
    stages = json.loads(out.stdout)["stages"]
    assert [round(s["total_gb"], 2) for s in stages] == [120.0, 31.41, 16.64, 1.88]
    assert math.isclose(stages[3]["params"], 2 * 7.5e9 / 64)


def test_plot_zero_memory_bars():
    from course_lib.notebook.plots import plot_zero_memory

    fig = plot_zero_memory(7.5e9, dp=64, gpu="v100")
    ax = fig.axes[0]
    # One stacked bar per stage and part (params, grads, optimizer; no activations here).
    heights = [p.get_height() for p in ax.patches]
    assert len(heights) == 12
    totals = [sum(heights[i::4]) for i in range(4)]
    assert totals == pytest.approx([120, 31.40625, 16.640625, 1.875])
    assert ax.get_lines()[0].get_ydata()[0] == pytest.approx(32.0)  # the V100's 32 GB
