"""Plots for the PRAM notebook: steps and work against n, kernel scaling, lost updates.

    from course_lib.pram import trace_plots
    rows = trace_plots.measure(["tree-sum", "prefix-hillis-steele", "prefix-blelloch"], [8, 64, 512])
    trace_plots.plot_work_time(rows)           # two panels: steps (time) and work against n

Every number drawn is measured: :func:`measure` runs each algorithm on the simulator and checks
its result before recording the counts. Each plot function returns a matplotlib Figure and
uses no pyplot (no global state); a notebook displays the Figure, a script calls
``fig.savefig(path)``. Pass ``axes`` (or ``ax``) to draw into existing Axes. (``from course_lib
import pram`` does not import this module, so the simulator itself never loads matplotlib.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure  # no pyplot: no global figure state

from .algorithms import check_n
from .catalog import get_algorithm
from .machine import run

__all__ = ["measure", "plot_kernel_scaling", "plot_lost_updates", "plot_work_time"]

DEFAULT_MAX_PROCESSORS = 1 << 16  # 65,536 simulated processors: a second or two per run


def measure(algorithms: Sequence[str], ns: Sequence[int], *, seed: int = 0,
            max_processors: int = DEFAULT_MAX_PROCESSORS) -> list[dict]:
    """Run every algorithm at every size and return one row per run:
    ``{algorithm, model, n, steps, work, processors, cost}`` (cost = steps x processors).

    Each algorithm runs under the model it is written for (see ``course pram --help``) and its
    result is checked against the expected one; a wrong result raises. Sizes at which an
    algorithm needs more than ``max_processors`` simulated processors (``max-crcw`` uses n^2,
    ``matmul`` n^3) are left out of its rows, so one list of sizes serves every algorithm;
    an algorithm left with no size at all is an error.
    """
    if not algorithms:
        raise ValueError("measure needs at least one algorithm name, e.g. ['tree-sum']")
    if not ns:
        raise ValueError("measure needs at least one size n, e.g. [8, 64, 512]")
    rows = []
    for name in algorithms:
        algo = get_algorithm(name)           # ValueError naming the known algorithms
        sizes = [check_n(algo.name, n, algo.power_of_two) for n in ns]
        sizes = [n for n in sizes if algo.processors(n) <= max_processors]
        if not sizes:
            raise ValueError(f"{algo.name} needs more than max_processors={max_processors:,} "
                             f"simulated processors at every n in {list(ns)}; give smaller sizes")
        for n in sizes:
            program = algo.build(n, seed=seed)
            result = run(program, algo.model, trace=False, max_processors=max_processors)
            wrong = program.verify(result)
            if wrong:
                raise AssertionError(f"{algo.name} at n={n} gave a wrong result: {wrong[0]}")
            rows.append({"algorithm": algo.name, "model": result.model, "n": n,
                         "steps": result.steps, "work": result.work,
                         "processors": result.processors,
                         "cost": result.steps * result.processors})
    return rows


def _figure(n_panels: int, figsize: tuple[float, float]):
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, list(fig.subplots(1, n_panels, squeeze=False)[0])


def _axes(axes, n_panels: int, figsize: tuple[float, float]):
    if axes is None:
        return _figure(n_panels, figsize)
    axes = list(axes) if isinstance(axes, (list, tuple)) else [axes]
    if len(axes) != n_panels:
        raise ValueError(f"pass {n_panels} Axes in axes=, got {len(axes)}")
    return axes[0].figure, axes


_MARKERS = "osD^vxP*"
_LINESTYLES = ("-", "--", "-.", ":")


def _style(i: int) -> dict:
    """Line style number ``i``: hollow markers of different shapes and sizes, so that series
    with identical counts (tree max, OR tree, EREW broadcast) stay visible on top of each other."""
    return {"marker": _MARKERS[i % len(_MARKERS)], "fillstyle": "none",
            "markersize": 10 - 1.5 * (i % 4), "linestyle": _LINESTYLES[i % len(_LINESTYLES)]}


def _series(rows: Sequence[Mapping], key: Sequence[str], x: str) -> dict:
    """``{key values: sorted [(x, row), ...]}``, in the order the keys first appear."""
    out: dict = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in key), []).append((r[x], r))
    return {k: sorted(v, key=lambda p: p[0]) for k, v in out.items()}


def plot_work_time(rows: Sequence[Mapping], axes=None, sequential: bool = True):
    """Steps (parallel time) and work (total operations) against n, one line per algorithm.

    ``rows``: the output of :func:`measure`. ``sequential`` draws n - 1, the operations of a
    sequential sum, on the work panel: a work-efficient algorithm runs parallel to it, a
    wasteful one (Hillis-Steele, CRCW max) climbs away from it. Both axes of the work panel are
    logarithmic; the steps panel has a log2 x-axis and a linear y-axis, so log2 n is a
    straight line and O(1) is flat.
    """
    if not rows:
        raise ValueError("plot_work_time needs rows from measure() to draw")
    missing = {"algorithm", "model", "n", "steps", "work"} - set(rows[0])
    if missing:
        raise ValueError(f"rows lack {sorted(missing)}: pass the output of measure()")
    fig, (ax_t, ax_w) = _axes(axes, 2, (11, 4))
    for i, ((algo, model), points) in enumerate(_series(rows, ("algorithm", "model"), "n").items()):
        ns = [n for n, _ in points]
        label = f"{algo} ({model})"
        line, = ax_t.plot(ns, [r["steps"] for _, r in points], label=label, **_style(i))
        ax_w.plot(ns, [r["work"] for _, r in points], label=label, color=line.get_color(),
                  **_style(i))
    if sequential:
        all_n = sorted({r["n"] for r in rows})
        ax_w.plot(all_n, [max(n - 1, 1) for n in all_n], color="grey", linestyle=":", lw=2.5, zorder=3,
                  label="n - 1 (a sequential sum)")  # on top: a work-efficient algorithm's line lies under it
    matmul = any("matmul" in r["algorithm"] for r in rows)
    xlabel = "n (input size; matrix side for matmul)" if matmul else "n (input size)"
    for ax in (ax_t, ax_w):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
    ax_w.set_yscale("log")
    ax_t.set_ylabel("steps (parallel time)")
    ax_w.set_ylabel("work (operations)")
    ax_t.set_title("Time: PRAM steps")
    ax_t.legend(fontsize=7)
    ax_w.set_title("Work: operations of all processors")
    ax_w.legend(fontsize=7)
    return fig


def plot_kernel_scaling(rows: Sequence[Mapping], dim: str, axes=None):
    """Steps and work of GPT-step kernels as one size ``dim`` grows, log-log.

    ``rows``: the output of ``pram.scaling(dim, values, kernels=[...])``; one line per kernel.
    A slope of 1 on the work panel means work grows linearly with ``dim``; a flat steps line
    means the kernel's parallel time does not depend on ``dim`` at all.
    """
    if not rows:
        raise ValueError("plot_kernel_scaling needs rows from pram.scaling() to draw")
    if dim not in rows[0]:
        raise ValueError(f"the rows have no column {dim!r}; they were made for "
                         f"{sorted(set(rows[0]) - {'kernel', 'steps', 'work', 'processors'})}")
    fig, (ax_t, ax_w) = _axes(axes, 2, (11, 4))
    for i, ((kernel,), points) in enumerate(_series(rows, ("kernel",), dim).items()):
        xs = [x for x, _ in points]
        line, = ax_t.plot(xs, [r["steps"] for _, r in points], label=kernel, **_style(i))
        ax_w.plot(xs, [r["work"] for _, r in points], label=kernel, color=line.get_color(),
                  **_style(i))
    for ax, what in ((ax_t, "steps (parallel time)"), (ax_w, "work (operations)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(dim)
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    ax_t.set_title(f"Steps as {dim} grows")
    ax_w.set_title(f"Work as {dim} grows")
    ax_w.legend(fontsize=7)
    return fig


def plot_lost_updates(rows: Sequence[Mapping], ax=None):
    """One bar per method: the share of the expected updates that survived, with the count lost.

    ``rows``: ``UpdateCount.as_row()`` dicts from :mod:`course_lib.pram.lost_updates`
    (``method``, ``expected``, ``got``, ``lost``). Racy read-modify-write falls short of 100 %;
    combining writes, locks and trees reach it exactly.
    """
    if not rows:
        raise ValueError("plot_lost_updates needs rows (UpdateCount.as_row()) to draw")
    for r in rows:
        if not r.get("expected"):
            raise ValueError(f"row {r!r} has no positive 'expected' count of updates")
    fig, (ax,) = _axes(ax, 1, (8, 0.45 * len(rows) + 1.2))
    labels = [f"{r['method']} ({r.get('workers', '?')} workers)" for r in rows]
    kept = [100.0 * r["got"] / r["expected"] for r in rows]
    colors = ["#55a868" if r["lost"] == 0 else "#c44e52" for r in rows]
    y = list(range(len(rows)))
    ax.barh(y, kept, color=colors)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    for i, r in enumerate(rows):
        text = "exact" if r["lost"] == 0 else f"{r['lost']:,} of {r['expected']:,} lost"
        ax.annotate(text, (kept[i], i), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.axvline(100, color="black", linewidth=0.8)
    ax.set_xlim(0, 135)
    ax.set_xlabel("updates that survived (%)")
    ax.set_title("Concurrent += into one cell: what survives")
    return fig

