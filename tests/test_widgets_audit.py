"""Edge cases of the notebook plots a student reaches: empty results, a zero baseline, one rank.

Each case used to fail deep inside matplotlib (or draw an empty figure) instead of saying what is
missing. The checks read what the figure holds (texts, labels), not its pixels.
"""

from __future__ import annotations

import pytest

from course_lib.notebook.plots import plot_collective_model, plot_speedup, plot_step_timeline
from course_lib.notebook.precision_plots import plot_recompute

_RECOMPUTE_ROW = {"recompute": "none", "act_mb": 10.0, "act_model_mb": 11.0, "compute_ms": 20.0}


@pytest.mark.parametrize("call, names", [
    (lambda: plot_speedup({}, 4), "speedup"),
    (lambda: plot_step_timeline([]), "profile_training_step"),
    (lambda: plot_recompute([]), "recompute_runs"),
])
def test_empty_results_raise_a_value_error_naming_what_is_missing(call, names):
    # before: TypeError "'int' object is not iterable" (max(ranks, *[])) and IndexError (rows[0])
    with pytest.raises(ValueError, match=names):
        call()


def test_recompute_ratios_need_a_nonzero_baseline():
    rows = [dict(_RECOMPUTE_ROW, compute_ms=0.0), dict(_RECOMPUTE_ROW, recompute="full", compute_ms=30.0)]
    fig = plot_recompute(rows)  # before: ZeroDivisionError
    a2 = fig.axes[1]  # the compute panel
    assert [p.get_height() for p in a2.patches] == [0.0, 30.0]  # the measured bars are still drawn
    assert not any(t.get_text().endswith("x") for t in a2.texts)  # no ratio to a 0 ms baseline
    # the usual case keeps its ratios to the first mode
    fig = plot_recompute([_RECOMPUTE_ROW, dict(_RECOMPUTE_ROW, recompute="full", compute_ms=30.0)])
    assert [t.get_text() for t in fig.axes[1].texts] == ["1.00x", "1.50x"]


def test_collective_model_refuses_what_a_log_axis_cannot_draw():
    # one rank moves nothing: every modelled time is 0, and the log axes drew an empty figure
    with pytest.raises(ValueError, match="p = 1"):
        plot_collective_model([2**10, 2**20], 1, alpha=1e-5, bandwidth=1e10)
    # a 0-byte message sat at x = 0 of the log2 axis: its point silently left out
    with pytest.raises(ValueError, match="message sizes"):
        plot_collective_model([0, 2**10], 4, alpha=1e-5, bandwidth=1e10)
    ax = plot_collective_model([2**10, 2**20], 2, alpha=1e-5, bandwidth=1e10).axes[0]
    assert all(min(line.get_ydata()) > 0 for line in ax.lines)  # p = 2 still draws
