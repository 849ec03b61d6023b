"""Plots for the course's models and benchmarks. Each function returns a matplotlib Figure and
keeps no global state (no pyplot): display it in a notebook, or ``fig.savefig(path)``.

Pass ``ax`` to draw into an existing Axes (the Figure returned is then ``ax.figure``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure  # no pyplot: no global figure state

from course_lib.analysis.comm_cost import COLLECTIVE_ALGORITHMS, collective_time
from course_lib.analysis.memory import STAGE_NAMES, STAGES, breakdown, resolve_gpu
from course_lib.analysis.scaling_laws import amdahl_speedup, gustafson_speedup
from course_lib.hardware import GB, MB, GiB, MiB
from course_lib.trainer.metrics import read_metrics

_PART_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868",
                "activations": "#c44e52"}


def _axes(ax, figsize=(7, 4)):
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


_UNIT_NAMES = {GB: "GB", MB: "MB", 1e3: "kB", 1.0: "bytes", GiB: "GiB", MiB: "MiB"}


def unit_name(unit: float) -> str:
    """An axis label's unit for bars divided by ``unit`` bytes ("MB" for 1e6, "MiB" for 2**20)."""
    return _UNIT_NAMES.get(unit, f"units of {unit:g} bytes")


def plot_memory(items: Mapping[str, object], memory_bytes: float | None = None,
                memory_label: str | None = None, title: str | None = None, ax=None, unit=GB):
    """Stacked bars of per-device memory (params, grads, optimizer, activations) per label.

    items: label -> :class:`course_lib.analysis.memory.MemoryBreakdown` (or anything with those four
    attributes, in bytes). memory_bytes: draw the device's memory as a horizontal line.
    """
    if not items:
        raise ValueError("plot_memory needs at least one breakdown to draw")
    fig, ax = _axes(ax)
    labels = list(items)
    bottom = [0.0] * len(labels)
    for part, color in _PART_COLORS.items():
        values = [getattr(items[k], part, 0.0) / unit for k in labels]
        if not any(values):
            continue
        ax.bar(labels, values, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:.3g}", (x, total), ha="center", va="bottom", fontsize=8)
    ax.margins(y=0.1)  # room above the tallest bar for its total
    if memory_bytes:
        ax.axhline(memory_bytes / unit, color="black", linestyle="--", linewidth=1,
                   label=memory_label or f"device memory ({memory_bytes / unit:g})")
    ax.set_ylabel(unit_name(unit) + " per device")
    ax.set_title(title or "Memory per device")
    ax.legend(fontsize=8)
    return fig


def plot_zero_memory(num_params: float | None = None, dp: int = 1, *, gpu=None, ax=None,
                     **breakdown_kwargs):
    """The four ZeRO stages side by side for one model (the ZeRO paper's Figure 1 as bars).

    Arguments as :func:`course_lib.analysis.memory.breakdown` (num_params or preset=..., k, dtype, ...);
    ``gpu``: a profile name such as "t4" to draw its memory.
    """
    items = {STAGE_NAMES[s]: breakdown(num_params, dp=dp, stage=s, **breakdown_kwargs)
             for s in STAGES}
    psi = next(iter(items.values())).num_params
    mem = resolve_gpu(gpu) if gpu is not None else None
    return plot_memory(items, mem[1] if mem else None, mem and f"{mem[0]} ({mem[1] / GB:g} GB)",
                       f"Psi = {psi:.3g} parameters, N_d = {dp}", ax=ax)


def plot_collective_model(nbytes: Sequence[float], p: int, alpha: float, bandwidth: float,
                          op: str = "all_reduce", algorithms: Sequence[str] | None = None, ax=None):
    """Alpha-beta model time against message size for each algorithm of ``op``
    (see :mod:`course_lib.analysis.comm_cost`)."""
    # both axes are logarithmic: a 0-byte message or a one-rank "collective" (every time 0) has
    # no place on them, and matplotlib would silently leave it out (p = 1: an empty figure)
    if p < 2:
        raise ValueError(f"plot_collective_model needs p >= 2 ranks, got p = {p}: "
                         "on one rank a collective moves nothing and takes no time")
    if len(nbytes) == 0 or min(nbytes) <= 0:  # len, not truth: nbytes may be a numpy array
        raise ValueError("plot_collective_model needs message sizes > 0 bytes (a log axis), "
                         f"got {list(nbytes)}")
    fig, ax = _axes(ax)
    for algo in algorithms or COLLECTIVE_ALGORITHMS[op]:
        times = [collective_time(op, n, p, alpha=alpha, bandwidth=bandwidth, algorithm=algo)
                 for n in nbytes]
        ax.plot(nbytes, times, label=algo)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size n (bytes)")
    ax.set_ylabel("time (s)")
    ax.set_title(f"{op}, p = {p}, alpha = {alpha:g} s, bandwidth = {bandwidth:g} B/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_loss_curve(rows: Sequence[Mapping] | str, title: str | None = None, ax=None):
    """Train loss per logged step and val loss at each evaluation against the iteration.

    rows: the rows of a run's ``metrics.csv`` (:func:`course_lib.trainer.metrics.read_metrics`), or the
    path of that file.
    """
    if isinstance(rows, str) or hasattr(rows, "__fspath__"):
        rows = read_metrics(rows)
    train = [(r["iter"], r["train_loss"]) for r in rows if not math.isnan(r.get("train_loss", math.nan))]
    val = [(r["iter"], r["val_loss"]) for r in rows if not math.isnan(r.get("val_loss", math.nan))]
    if not train and not val:
        raise ValueError("plot_loss_curve needs metrics rows with train_loss or val_loss")
    fig, ax = _axes(ax)
    if train:
        ax.plot(*zip(*train), linewidth=1, alpha=0.8, label="train loss (logged steps)")
    if val:
        ax.plot(*zip(*val), marker="o", markersize=4, label="val loss (evaluations)")
        best = min(val, key=lambda p: p[1])
        ax.annotate(f"{best[1]:.4f}", best, textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title or "Training loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_speedup(speedup: Mapping[str, float], ranks: int, title: str | None = None, ax=None):
    """Bars of speedup over one process per strategy, with the two reference lines labelled.

    speedup: strategy -> tokens/s over the one-process baseline's (weak scaling), a dict or Series. The line at 1x
    is "as fast as one process": a bar below it is *slower* than one process (drawn in red). The
    line at ``ranks``x is the ideal when every rank brings its own device (Gustafson 1988).
    """
    pairs = dict(speedup.items())  # a dict or a pandas Series (index = strategy)
    if not pairs:
        raise ValueError("plot_speedup needs at least one strategy's speedup (strategy -> speedup)")
    fig, ax = _axes(ax)
    names, values = list(pairs), [float(v) for v in pairs.values()]
    colors = ["#c0392b" if v < 1 else "#2e86c1" for v in values]
    ax.bar(names, values, color=colors)
    for x, v in enumerate(values):
        ax.annotate(f"{v:.2f}×", (x, v), ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=1, label="1× = one process (below: slower than one process)")
    ax.axhline(ranks, color="grey", linewidth=1, linestyle="--", label=f"{ranks}× = ideal for {ranks} ranks")
    ax.set_ylim(0, max(ranks, *values) * 1.25)
    ax.set_ylabel("speedup over one process (×)")
    ax.set_title(title or f"Speedup over one process ({ranks} ranks)")
    ax.tick_params(axis="x", labelrotation=30)
    ax.legend(fontsize=8, loc="upper right")
    return fig


def plot_scaling(strong: Sequence[dict], s_fit: float, weak: Sequence[dict] | None = None,
                 s_written: float | None = None, p_max: int = 1024):
    """Two panels: measured strong-scaling speedups with Amdahl's curve for ``s_fit``; and the
    laws extrapolated to ``p_max`` processors (Amdahl's ceiling 1/s vs Gustafson's line), with the
    measured weak-scaling points. Returns a matplotlib Figure.

    Rows as :func:`course_lib.experiments.scaling_measure.measure_strong` and ``measure_weak``
    return them; the laws are :mod:`course_lib.analysis.scaling_laws`."""
    if not strong:
        raise ValueError("plot_scaling needs strong-scaling rows (measure_strong)")
    amdahl_speedup(s_fit, 1)  # checks 0 <= s_fit <= 1 before anything is drawn
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    ps = [r["p"] for r in strong]
    grid = [1 + i * (max(ps) - 1) / 50 for i in range(51)]
    ax1.plot(grid, grid, "k:", label="ideal: S = p")
    ax1.plot(grid, [amdahl_speedup(s_fit, p) for p in grid], label=f"Amdahl, fitted s = {s_fit:.3f}")
    if s_written is not None:
        ax1.plot(grid, [amdahl_speedup(s_written, p) for p in grid], "--",
                 label=f"Amdahl, serial part written in s = {s_written:.3f}")
    ax1.plot(ps, [r["speedup"] for r in strong], "o", color="C3", label="measured")
    ax1.set_xlabel("processes p")
    ax1.set_xticks(ps)  # whole processes only (2 cores: 1.2, 1.4, ... otherwise)
    ax1.set_ylabel("speedup T(1) / T(p)")
    ax1.set_title("Strong scaling on this machine")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)

    big = [2 ** k for k in range(max(1, p_max).bit_length())]
    ax2.plot(big, big, "k:", label="ideal")
    ax2.plot(big, [amdahl_speedup(s_fit, p) for p in big], marker=".",
             label=f"Amdahl (fixed job), fitted s = {s_fit:.3f}, ceiling {1 / s_fit:.0f}" if s_fit
             else "Amdahl (fixed job), fitted s = 0")
    if s_written is not None:
        ax2.plot(big, [amdahl_speedup(s_written, p) for p in big], "--",
                 label=f"Amdahl, s = {s_written:.3f} as written, ceiling {1 / s_written:.0f}" if s_written
                 else "Amdahl, s = 0 as written")
    s_weak = statistics.mean(r["serial_share"] for r in weak) if weak else s_fit
    ax2.plot(big, [gustafson_speedup(s_weak, p) for p in big], marker=".",
             label=f"Gustafson (growing job), s' = {s_weak:.3f}")
    if weak:
        ax2.plot([r["p"] for r in weak], [r["scaled_speedup"] for r in weak], "o", color="C3",
                 label="measured scaled speedup")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel("processes p")
    ax2.set_ylabel("speedup")
    ax2.set_title("Extrapolated: fixed vs growing job")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3, which="both")
    return fig


def plot_step_timeline(results: list[dict], title: str | None = None, ax=None):
    """The profiled step of every rank: a lane of phases, one of compute, one of communication.

    results: :func:`course_lib.experiments.profiling.profile_training_step`'s, one dict per rank."""
    if not results:
        raise ValueError("plot_step_timeline needs the results of profile_training_step, one dict per rank")
    if ax is None:
        ax = Figure(figsize=(9, 0.6 + 1.2 * len(results)), layout="constrained").add_subplot()
    colors = {"compute": "#4c72b0", "comm": "#dd8452"}
    shades = ("#e0e0e0", "#c8c8c8")
    ticks, labels = [], []
    for k, r in enumerate(results):
        base = 4 * (len(results) - 1 - k)  # rank 0 on top
        width = max(r["step_ms"], 1e-9)
        for i, (name, (s, e)) in enumerate(sorted(r["phases"].items(), key=lambda p: p[1][0])):
            ax.broken_barh([(s, e - s)], (base + 2 - 0.4, 0.8), color=shades[i % 2])
            if e - s > 0.06 * width:  # a label only where it fits
                ax.text((s + e) / 2, base + 2, name, ha="center", va="center", fontsize=7)
        for lane, kind in enumerate(("compute", "comm")):
            y = base + 1 - lane
            ax.broken_barh([(s, e - s) for s, e in r[kind]], (y - 0.4, 0.8), color=colors[kind],
                           label=kind if k == 0 else None)
        ticks += [base + 2, base + 1, base]
        labels += [f"rank {r['rank']} phases", "compute", "comm"]
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("ms since the step started (each rank's own clock)")
    ax.set_title(title or f"one step of {results[0]['strategy']} on {len(results)} ranks")
    ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, -0.12), ncol=2)
    ax.set_ylim(-0.7, 4 * len(results) - 1.3)
    return ax.figure


def plot_pipeline_bubble(rows: list[dict], ax=None):
    """Measured bubble against the number of micro-batches m, per schedule, with the formula
    (p - 1) / (m + p - 1) as a line. ``rows``: the dicts of all ranks of
    :func:`course_lib.experiments.model_parallel_check.measure_pipeline_bubble`."""
    if not rows:
        raise ValueError("plot_pipeline_bubble needs the rows of measure_pipeline_bubble")
    fig, ax = _axes(ax)
    p = rows[0]["p"]
    ms = sorted({r["m"] for r in rows})
    fine = [m / 4 for m in range(4, 4 * max(ms) + 1)]
    ax.plot(fine, [(p - 1) / (m + p - 1) for m in fine], color="black", linewidth=1,
            label="(p-1)/(m+p-1)")
    for schedule, marker, size in (("afab", "o", 11), ("1f1b", "s", 5)):  # equal bubbles: nest them
        for key, fill in (("bubble (ticks)", True), ("bubble (wall)", False)):
            pts = [(m, sum(r[key] for r in rows if r["m"] == m and r["schedule"] == schedule) /
                    max(1, sum(1 for r in rows if r["m"] == m and r["schedule"] == schedule)))
                   for m in ms if any(r["schedule"] == schedule for r in rows)]
            if pts:
                ax.plot(*zip(*pts), marker=marker, linestyle="none", markersize=size,
                        fillstyle="full" if fill else "none",
                        label=f"{schedule}, {'logical clock' if fill else 'wall time'}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, labels=[str(m) for m in ms])
    ax.set_xlabel("micro-batches per step m")
    ax.set_ylabel("idle fraction of the step (bubble)")
    ax.set_title(f"Pipeline bubble, p = {p} stages (mean over stages)")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig
