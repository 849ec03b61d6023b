"""Plots for the mixed-precision lesson (notebook 9). Each returns a matplotlib Figure, no pyplot.

    from course_lib.notebook.precision_plots import plot_formats, plot_gradient_histogram

The numbers come from :mod:`course_lib.analysis.precision` (formats, closed forms) and
:mod:`course_lib.experiments.precision` (measured on the course model).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from course_lib.hardware import MB
from course_lib.notebook.plots import _axes, unit_name

_ROLE_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868",
                "activations": "#c44e52"}


def plot_formats(formats: Sequence, ax=None):
    """Each format's range on a log2 axis: subnormals (light), normals (dark), and the relative
    step between neighbouring numbers (eps) written next to it."""
    fig, ax = _axes(ax, (8, 3.2))
    for i, f in enumerate(formats):
        lo, normal, hi = (math.log2(v) for v in (f.smallest_subnormal, f.smallest_normal, f.max))
        ax.barh(i, normal - lo, left=lo, color="#9ecae1")
        ax.barh(i, hi - normal, left=normal, color="#3182bd")
        ax.text(hi + 2, i, f"max {f.max:.3g}, eps 2^-{f.mantissa}", va="center", fontsize=8)
    ax.set_yticks(range(len(formats)), [f"{f.name} ({f.bits} bit)" for f in formats])
    ax.invert_yaxis()
    ax.set_xlabel("log2 |x|  (light: subnormal, dark: normal)")
    ax.set_xlim(-160, 200)
    ax.set_title("Floating-point formats: range (exponent bits) and precision (mantissa bits)")
    return fig


def plot_gradient_histogram(magnitudes, scales: Sequence[float] = (1.0,), ax=None, bins: int = 80):
    """Histogram of log2 |g| of fp32 gradient values (zeros left out), shifted by log2 of each
    loss scale, against fp16's limits: below 2^-24 a value is lost, above 65504 it overflows
    (Micikevicius et al. 2018, Fig. 3)."""
    fig, ax = _axes(ax, (8, 3.5))
    g = np.asarray(magnitudes, dtype=np.float64)
    logs = np.log2(g[g > 0])
    for scale in scales:
        ax.hist(logs + math.log2(scale), bins=bins, histtype="step", linewidth=1.5,
                label=f"loss scale 2^{math.log2(scale):.0f}")
    for x, text in ((-24, "fp16 smallest subnormal 2^-24"), (-14, "fp16 smallest normal 2^-14"),
                    (math.log2(65504), "fp16 max 65504")):
        ax.axvline(x, color="k", linestyle="--", linewidth=1)
        ax.text(x, ax.get_ylim()[1] * 0.95, text, rotation=90, va="top", ha="center", fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})  # readable over the curves
    ax.axvspan(ax.get_xlim()[0], -25, color="#c44e52", alpha=0.12)
    ax.set_xlabel("log2 |gradient value|")
    ax.set_ylabel("values")
    ax.set_yscale("log")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Gradient values of the course model against fp16's range")
    return fig


def plot_loss_scaling(rows: Sequence[Mapping], ax=None):
    """Relative gradient error and the share of flushed values against the loss scale, one line
    per dtype; overflowing scales are marked with an x on the axis."""
    fig, ax = _axes(ax, (10, 3.5))
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        rs = [r for r in rows if r["dtype"] == dtype]
        ok = [r for r in rs if not r["overflow"]]
        ax.plot([math.log2(r["scale"]) for r in ok], [r["rel_err"] for r in ok], "o-",
                label=f"{dtype}: |g - g32| / |g32|")
        ax.plot([math.log2(r["scale"]) for r in ok], [max(r["flushed"], 1e-7) for r in ok], "s:",
                label=f"{dtype}: share flushed to 0 (none: drawn at 1e-7)")
        bad = [math.log2(r["scale"]) for r in rs if r["overflow"]]
        if bad:
            ax.plot(bad, [1.0] * len(bad), "x", color="k", markersize=10, label=f"{dtype}: overflow (step skipped)")
    ax.set_yscale("log")
    ax.set_xlabel("log2 loss scale")
    ax.set_ylabel("error, or share of values")
    ax.set_title("Loss scaling: too small loses gradients, too large overflows")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: covers no point
    return fig


def plot_state_bytes(bars: Mapping[str, Mapping[str, float]], ax=None, unit: float = MB):
    """Stacked bars of bytes by role (params, grads, optimizer, activations) per label."""
    fig, ax = _axes(ax, (7, 3.8))
    labels = list(bars)
    bottom = [0.0] * len(labels)
    for role, color in _ROLE_COLORS.items():
        values = [bars[k].get(role, 0.0) / unit for k in labels]
        ax.bar(labels, values, bottom=bottom, color=color, label=role)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel(unit_name(unit))  # the unit the bars are in
    ax.legend(fontsize=8)
    ax.set_title("Where the bytes go")
    return fig


def plot_recompute(rows: Sequence[Mapping], ax=None):
    """Two panels: measured and modelled activation MB per recompute mode, and compute ms/step
    (written over each bar as a multiple of the first mode's, when that is a positive time)."""
    if not rows:
        raise ValueError("plot_recompute needs the rows of recompute_runs, one per recompute mode")
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    a1, a2 = fig.subplots(1, 2)
    modes = [r["recompute"] for r in rows]
    x = range(len(modes))
    a1.bar([i - 0.2 for i in x], [r["act_mb"] for r in rows], 0.4, label="measured")
    a1.bar([i + 0.2 for i in x], [r["act_model_mb"] for r in rows], 0.4, label="model (Korthikanti)")
    a1.set_xticks(list(x), modes)
    a1.set_ylabel("activation MB per rank")
    a1.legend(fontsize=8)
    a2.bar(modes, [r["compute_ms"] for r in rows], color="#55a868")
    base = rows[0]["compute_ms"]
    if base > 0:  # a 0 or NaN ms baseline has no ratios (the bars still show the times)
        for i, r in enumerate(rows):
            a2.text(i, r["compute_ms"], f"{r['compute_ms'] / base:.2f}x", ha="center", va="bottom")
    a2.set_ylabel("compute ms per step")
    fig.suptitle("Activation recomputation: memory for compute")
    return fig


def plot_loss_curves(curves: Mapping[str, tuple[Sequence[int], Sequence[float]]], ax=None,
                     title: str = "Training loss"):
    """One line per run: label -> (iters, losses)."""
    fig, ax = _axes(ax, (7, 3.5))
    for label, (its, losses) in curves.items():
        ax.plot(its, losses, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("train loss")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return fig
