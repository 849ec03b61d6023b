"""course_lib.pram.trace_plots: measured rows carry the textbook counts, and the plots draw them.

Counts: tree sum log2 n steps and n - 1 additions (JaJa 1992, sec. 2.1); Hillis-Steele log2 n
steps and n log2 n - n + 1 additions (Hillis & Steele 1986); CRCW max 3 steps with n^2
processors (JaJa 1992, sec. 2.6.1); matmul 1 + log2 n steps with n^3 processors (JaJa 1992,
sec. 1.3).
"""

from __future__ import annotations

import math

import pytest

from course_lib import pram
from course_lib.pram import lost_updates
from course_lib.pram import trace_plots as plots


def test_measure_gives_the_textbook_counts():
    rows = plots.measure(["tree-sum", "prefix-hillis-steele", "max-crcw", "matmul"], [8, 1024],
                         max_processors=1 << 12)
    got = {(r["algorithm"], r["n"]): (r["steps"], r["work"], r["processors"]) for r in rows}
    assert got[("tree-sum", 8)] == (3, 7, 4)
    assert got[("tree-sum", 1024)] == (10, 1023, 512)
    assert got[("prefix-hillis-steele", 8)] == (3, 17, 8)
    assert got[("prefix-hillis-steele", 1024)] == (10, 9217, 1024)
    assert got[("max-crcw", 8)][0] == 3 and got[("max-crcw", 8)][2] == 64
    assert got[("matmul", 8)][0] == 1 + 3 and got[("matmul", 8)][2] == 8 ** 3
    # n^2 = 1,048,576 and n^3 processors exceed the limit: those sizes are left out
    assert ("max-crcw", 1024) not in got and ("matmul", 1024) not in got
    for r in rows:
        assert r["cost"] == r["steps"] * r["processors"]
        assert r["model"] == pram.get_algorithm(r["algorithm"]).model


def test_measure_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown PRAM algorithm 'bogus'"):
        plots.measure(["bogus"], [8])
    with pytest.raises(ValueError, match="power of two, got n=6"):
        plots.measure(["tree-sum"], [6])
    with pytest.raises(ValueError, match="at least one size"):
        plots.measure(["tree-sum"], [])
    with pytest.raises(ValueError, match="at least one algorithm"):
        plots.measure([], [8])
    with pytest.raises(ValueError, match="max-crcw needs more than max_processors=100"):
        plots.measure(["max-crcw"], [16, 32], max_processors=100)


def test_plot_work_time_draws_every_measured_point():
    rows = plots.measure(["tree-sum", "prefix-blelloch"], [4, 16, 64])
    fig = plots.plot_work_time(rows)
    ax_t, ax_w = fig.axes
    lines = {ln.get_label(): ln for ln in ax_w.get_lines()}
    assert list(lines) == ["tree-sum (EREW)", "prefix-blelloch (EREW)", "n - 1 (a sequential sum)"]
    assert list(lines["tree-sum (EREW)"].get_ydata()) == [3, 15, 63]
    steps = {ln.get_label(): list(ln.get_ydata()) for ln in ax_t.get_lines()}
    # Blelloch: up-sweep, clear, down-sweep = 2 log2 n + 1 steps (Blelloch 1990)
    assert steps["prefix-blelloch (EREW)"] == [2 * math.log2(n) + 1 for n in (4, 16, 64)]
    assert ax_w.get_yscale() == "log" and ax_t.get_xscale() == "log"
    no_ref = plots.plot_work_time(rows, sequential=False)
    assert len(no_ref.axes[1].get_lines()) == 2


def test_plot_work_time_into_given_axes_and_bad_rows():
    from matplotlib.figure import Figure

    fig = Figure()
    axes = fig.subplots(1, 2)
    rows = plots.measure(["or-crcw"], [4, 8])
    assert plots.plot_work_time(rows, axes=list(axes)) is fig
    assert [list(ln.get_ydata()) for ln in axes[0].get_lines()] == [[1, 1]]
    with pytest.raises(ValueError, match="pass 2 Axes"):
        plots.plot_work_time(rows, axes=[axes[0]])
    with pytest.raises(ValueError, match="needs rows"):
        plots.plot_work_time([])
    with pytest.raises(ValueError, match="pass the output of measure"):
        plots.plot_work_time([{"n": 4, "steps": 1}])


def test_plot_kernel_scaling_matches_the_cost_formulas():
    kernels = ["matmul_forward (qkv)", "attention_forward"]
    rows = pram.scaling("T", [4, 8, 16], kernels=kernels)
    fig = plots.plot_kernel_scaling(rows, "T")
    ax_t, ax_w = fig.axes
    for ln in ax_w.get_lines():
        want = [pram.cost(ln.get_label(), pram.GPTShape(T=t))["work"] for t in (4, 8, 16)]
        assert list(ln.get_ydata()) == want
    # a matmul's parallel time does not grow with T; attention's does (a loop over T)
    steps = {ln.get_label(): list(ln.get_ydata()) for ln in ax_t.get_lines()}
    assert len(set(steps["matmul_forward (qkv)"])) == 1
    assert steps["attention_forward"][0] < steps["attention_forward"][-1]
    with pytest.raises(ValueError, match="no column 'C'"):
        plots.plot_kernel_scaling(rows, "C")
    with pytest.raises(ValueError, match="needs rows"):
        plots.plot_kernel_scaling([], "T")


def test_plot_lost_updates_shows_lost_and_exact():
    rows = [lost_updates.racy_threads(workers=2, updates=50, lockstep=True).as_row(),
            lost_updates.tree_threads(workers=2, updates=50).as_row()]
    assert rows[0]["lost"] == 50 and rows[1]["lost"] == 0   # lockstep: (workers - 1) * updates
    fig = plots.plot_lost_updates(rows)
    (ax,) = fig.axes
    widths = [p.get_width() for p in ax.patches]
    assert widths == [50.0, 100.0]
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["50 of 100 lost", "exact"]
    with pytest.raises(ValueError, match="no positive 'expected'"):
        plots.plot_lost_updates([{"method": "x", "expected": 0, "got": 0, "lost": 0}])
    with pytest.raises(ValueError, match="needs rows"):
        plots.plot_lost_updates([])
