"""The memory calculator of notebook 4: move a control, the numbers follow the memory model.

The expected figures are computed independently from the ZeRO paper's formulas (Rajbhandari et
al. 2020, Sec. 5 and Figure 1: Psi = 7.5e9, N_d = 64, K = 12 gives 120, 31.4, 16.6 and 1.9 GB)
and from :func:`course_lib.analysis.memory.breakdown` for the activations (tested in test_memory.py).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from course_lib.analysis.memory import GB, PRESETS, breakdown
from course_lib.notebook.widgets import (
    CUSTOM,
    Settings,
    calculate,
    memory_calculator,
    summary_html,
)


def _shown_gb(calc, part: str) -> float:
    """The number the calculator's table shows for ``part`` (what a student reads)."""
    m = re.search(rf'data-part="{part}">(?:<b>)?([0-9.]+)', calc.summary.value)
    assert m, f"no {part} cell in the summary"
    return float(m.group(1))


def test_paper_figure1_by_moving_the_stage_control():
    calc = memory_calculator(model=CUSTOM, params_b=7.5, dp=64, stage=0, plot=False)
    shown = {}
    for stage in (0, 1, 2, 3):
        calc.controls["stage"].value = stage
        shown[stage] = _shown_gb(calc, "total")
    # ZeRO paper Figure 1: (2 + 2 + 12) Psi, 4 Psi + 12 Psi / N, 2 Psi + 14 Psi / N, 16 Psi / N
    psi, n = 7.5e9, 64
    expected = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    for stage, nbytes in expected.items():
        assert shown[stage] == pytest.approx(nbytes / GB, abs=5e-4)
    assert [round(shown[s], 1) for s in (0, 1, 2, 3)] == [120.0, 31.4, 16.6, 1.9]  # as printed
    assert _shown_gb(calc, "activations") == 0.0  # no shape, no activations


def test_dp_slider_shrinks_only_the_sharded_parts():
    calc = memory_calculator(model="gpt2-medium", dp=1, stage=2, plot=False)
    before = calc.result.breakdown
    calc.controls["dp"].value = 8
    after = calc.result.breakdown
    assert after.params == before.params  # stage 2 keeps whole parameters
    assert after.grads == pytest.approx(before.grads / 8)
    assert after.optimizer == pytest.approx(before.optimizer / 8)
    assert after.activations == before.activations  # data parallelism does not split a micro-batch
    ref = breakdown(preset="gpt2-medium", dp=8, stage=2, batch_size=PRESETS["gpt2-medium"].batch_size)
    assert after.total == pytest.approx(ref.total)
    assert _shown_gb(calc, "total") == pytest.approx(ref.total / GB, abs=5e-4)


def test_recompute_dtype_and_batch_controls_match_the_model():
    calc = memory_calculator(model="gpt2", plot=False)
    acts = {}
    for mode in ("none", "selective", "full"):
        calc.controls["recompute"].value = mode
        acts[mode] = calc.result.breakdown.activations
        assert acts[mode] == pytest.approx(breakdown(preset="gpt2", recompute=mode).activations)
    assert acts["none"] > acts["selective"] > acts["full"] > 0
    calc.controls["batch_size"].value = 24  # twice nanoGPT's 12: activations nearly double
    assert calc.result.breakdown.activations == pytest.approx(
        breakdown(preset="gpt2", recompute="full", batch_size=24).activations)
    calc.controls["dtype"].value = "fp32"
    b = calc.result.breakdown
    psi = PRESETS["gpt2"].num_params()
    assert (b.params, b.grads, b.optimizer) == pytest.approx((4 * psi, 4 * psi, 8 * psi))


def test_choosing_a_preset_resets_its_micro_batch_and_disables_the_size_slider():
    calc = memory_calculator(model="gpt2", plot=False)
    calc.controls["batch_size"].value = 3
    calc.controls["model"].value = "shakespeare_char"
    assert calc.controls["batch_size"].value == PRESETS["shakespeare_char"].batch_size
    assert calc.controls["params_b"].disabled
    assert calc.result.breakdown.num_params == PRESETS["shakespeare_char"].num_params()
    calc.controls["model"].value = CUSTOM
    assert not calc.controls["params_b"].disabled and calc.controls["batch_size"].disabled
    calc.controls["params_b"].value = 1.0
    assert calc.result.total == pytest.approx(16e9)


def test_gpu_verdict_and_advice():
    # GPT-2 XL on a 16 GB T4, plain DP: 16 x 1.56e9 = 25 GB of states alone -> does not fit
    calc = memory_calculator(model="gpt2-xl", dp=8, gpu="t4", plot=False)
    assert not calc.result.fits and 'data-fits="false"' in calc.summary.value
    calc.controls["flash_attention"].value = True
    calc.controls["recompute"].value = "full"
    advice = calc.result.advice()
    stage = next(s for s in (1, 2, 3) if calc.result.stages[s].total <= 16e9)
    assert advice and advice[0].startswith(f"ZeRO stage {stage} fits")
    calc.controls["stage"].value = stage
    assert calc.result.fits and calc.result.advice() == []
    assert "fits</b> on t4" in calc.summary.value
    calc.controls["gpu"].value = "a100-80gb"
    assert calc.result.gpu_bytes == 80e9


def test_plot_is_redrawn_when_a_control_moves():
    calc = memory_calculator(model="gpt2", dp=2)
    first = calc.image.value
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    calc.controls["stage"].value = 3
    assert calc.image.value != first


def test_bad_settings_raise_before_building_widgets():
    with pytest.raises(ValueError, match="power|dp must be one of"):
        memory_calculator(dp=3)
    with pytest.raises(ValueError, match="gpu must be one of"):
        memory_calculator(gpu="gtx480")
    with pytest.raises(ValueError, match="unknown model"):
        calculate(Settings(model="gpt5"))
    with pytest.raises(ValueError, match="dtype"):
        memory_calculator(dtype="int8")
    # each once a KeyError, a TypeError from a comparison, or a silent other number (0: the preset's
    # batch; 500: the slider's end, 128)
    with pytest.raises(ValueError, match="ZeRO stage must be 0"):
        memory_calculator(stage=7)
    with pytest.raises(ValueError, match="parameter count must be a number > 0"):
        memory_calculator(model=CUSTOM, params_b="7")
    with pytest.raises(TypeError, match="calculate takes a Settings"):
        calculate({"model": "gpt2"})
    for batch in (0, 500, 2.5):
        with pytest.raises(ValueError, match="batch_size must be a whole number from 1 to 128"):
            memory_calculator(batch_size=batch)
    with pytest.raises(ValueError, match="batch_size must be"):
        breakdown(preset="gpt2", batch_size=0)
    with pytest.raises(ValueError, match="seq_len must be"):
        breakdown(preset="gpt2", seq_len=0)
    with pytest.raises(ValueError, match="num_params must be a number > 0"):
        breakdown("7.5e9")


def test_summary_without_widgets():
    html = summary_html(calculate(Settings(model=CUSTOM, params_b=1.0, dp=4, stage=3)))
    assert 'data-total-gb="4"' in html  # 16 bytes x 1e9 / 4


def test_import_has_no_side_effects():
    code = ("import sys, course_lib.notebook.widgets; "
            "print('ipywidgets' in sys.modules, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_custom_size_is_exact_and_a_preset_shows_its_own():
    calc = memory_calculator(model=CUSTOM, params_b=7.5, dp=1, stage=0, plot=False)
    assert calc.settings().params_b == 7.5 and calc.result.total == 16 * 7.5e9  # no slider grid
    calc.controls["model"].value = "gpt2-xl"
    assert calc.controls["params_b"].disabled
    assert calc.controls["params_b"].value == round(PRESETS["gpt2-xl"].num_params() / 1e9, 4)


def test_saved_output_shows_the_calculator_without_a_kernel():
    from course_lib.notebook.static import WIDGET_VIEW

    calc = memory_calculator(model="gpt2-xl", dp=8, gpu="a100-40gb")
    bundle = calc._repr_mimebundle_()
    assert WIDGET_VIEW in bundle  # the live widget for a running kernel
    html, text = bundle["text/html"], bundle["text/plain"]  # and its state for every other viewer
    assert 'data-part="total"' in html and 'src="data:image/png;base64,' in html
    assert "model: <b>gpt2-xl" in html and "GPU to fit on: <b>a100-40gb</b>" in html
    assert "<i>(fixed)</i>" in html  # the preset's size cannot be changed
    assert "HBox(" not in text and "total" in text and "does not fit" in text


def test_memory_axis_names_its_unit():
    from course_lib.notebook.plots import plot_memory

    b = breakdown(num_params=1e6)
    assert plot_memory({"a": b}, unit=1e6).axes[0].get_ylabel() == "MB per device"
    assert plot_memory({"a": b}).axes[0].get_ylabel() == "GB per device"


def test_speedup_plot_labels_its_reference_lines_and_marks_slower_bars():
    from course_lib.notebook.plots import plot_speedup

    import pandas as pd

    ax = plot_speedup(pd.Series({"single": 1.0, "ddp": 1.2, "zero3": 0.6}), ranks=2).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["single", "ddp", "zero3"]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["1× = one process (below: slower than one process)", "2× = ideal for 2 ranks"]
    assert [line.get_ydata()[0] for line in ax.lines] == [1.0, 2]
    red = [p.get_facecolor()[:3] for p in ax.patches]
    assert red[2] != red[1] and red[0] == red[1]  # only the bar below 1 is drawn in the warning colour
    assert [t.get_text() for t in ax.texts] == ["1.00×", "1.20×", "0.60×"]


def test_snapshot_of_an_interactive_explorer_shows_what_it_prints():
    import ipywidgets as widgets

    from course_lib.notebook.static import with_snapshot

    def explain(gpu, params_billion):
        print(f"{params_billion:.3g} B parameters on {gpu}")

    explorer = widgets.interactive(explain, gpu=widgets.Dropdown(options=["t4", "a100"], value="t4", description="GPU"),
                                   params_billion=widgets.FloatSlider(value=1.5, min=0.1, max=10, description="params (B)"))
    explorer.children[1].value = 7.0
    bundle = with_snapshot(explorer)._repr_mimebundle_()
    assert "GPU: <b>t4</b>" in bundle["text/html"] and "params (B): <b>7.00</b>" in bundle["text/html"]
    assert "7 B parameters on t4" in bundle["text/plain"] and "interactive(" not in bundle["text/plain"]
    # a SelectionSlider still on its first option has the label '': the snapshot shows its value
    ranks = widgets.interactive(lambda n: print(n), n=widgets.SelectionSlider(options=[1, 2, 4], value=1,
                                                                             description="DP ranks N_d"))
    assert "DP ranks N_d: <b>1</b>" in with_snapshot(ranks)._repr_mimebundle_()["text/html"]


def test_autocast_dtype_matches_what_the_trainer_holds():
    """The 'autocast' layout: fp32 states (16 bytes per parameter) and 16-bit activations with
    autocast's fp32 residual stream and weight copies, as breakdown(dtype='autocast') (checked
    against autograd's saved tensors in tests/test_precision.py)."""
    calc = memory_calculator(model="shakespeare_char_cpu", plot=False)
    calc.controls["dtype"].value = "autocast"
    b = calc.result.breakdown
    psi = PRESETS["shakespeare_char_cpu"].num_params()
    assert (b.params, b.grads, b.optimizer) == pytest.approx((4 * psi, 4 * psi, 8 * psi))
    assert b.activations == pytest.approx(breakdown(preset="shakespeare_char_cpu", dtype="autocast").activations)
    mixed = breakdown(preset="shakespeare_char_cpu", dtype="mixed").activations
    fp32 = breakdown(preset="shakespeare_char_cpu", dtype="fp32").activations
    assert mixed < b.activations < fp32  # more than Korthikanti's 16-bit count, less than fp32
    calc.controls["recompute"].value = "full"
    assert calc.result.breakdown.activations < b.activations / 3
