"""The frameworks lesson's figures (notebook 11): loss curves of the course's and Fabric's runs over
one process, the labs' strategy table as bars, and one FSDP2 step as a timeline.

    from course_lib.notebook.frameworks_plots import plot_runs_vs_one_process, plot_strategy_table
    plot_runs_vs_one_process(results[0])          # experiments.frameworks_gpt.compare_runs, rank 0
    plot_strategy_table(experiments.frameworks_qa.strategy_table(...))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt


def plot_runs_vs_one_process(result: Mapping, runs: Sequence[str] | None = None):
    """Left: every run's loss per step over the one-process reference (they lie on it). Right:
    each run's |loss - one process| per step, on a log scale (float rounding, or a bug)."""
    runs = [r for r in (runs or result) if isinstance(result.get(r), Mapping) and "losses" in result[r]]
    ref = result["reference"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    steps = range(1, len(ref) + 1)
    left.plot(steps, ref, color="black", lw=5, alpha=0.25, label="one process")
    markers = "os^vD<>"
    for i, run in enumerate(runs):
        losses = result[run]["losses"]
        left.plot(steps, losses, marker=markers[i % len(markers)], ms=5, lw=1, label=run)
        diff = [max(abs(a - b), 1e-9) for a, b in zip(losses, ref)]
        right.semilogy(steps, diff, marker=markers[i % len(markers)], ms=5, lw=1, label=run)
    left.set(xlabel="step", ylabel="loss of the global batch", title="every run over one process")
    for ax in (left, right):
        ax.set_xticks(list(steps))
    right.set(xlabel="step", ylabel="|loss - one process| (floor 1e-9)", title="how far from one process",
              ylim=(1e-10, 1))
    left.legend(fontsize=8)
    right.legend(fontsize=7, loc="upper right", ncol=2)  # above the tolerance: where no run should be
    tol = 1e-5 * max(ref) + 1e-6  # tests/test_frameworks.py: pytest.approx(rel=1e-5, abs=1e-6)
    right.axhline(tol, color="gray", ls=":", lw=1)
    right.text(1, 1.5 * tol, "the tests' tolerance (1e-5 of the loss)", fontsize=8, color="gray")
    fig.tight_layout()
    return fig


def plot_strategy_table(table: Sequence[Mapping]):
    """The labs' table as bars: seconds, speedup over the one-rank baseline, peak memory and model
    states per rank, for the strategies that ran (refused ones are named under the bars)."""
    ran = [r for r in table if r.get("seconds") is not None]
    refused = [r["strategy"] for r in table if r.get("seconds") is None]
    names = [f"{r['strategy']}\n({r['ranks']} rank{'s' if r['ranks'] > 1 else ''})" for r in ran]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(names, [r["seconds"] for r in ran], color="tab:blue")
    axes[0].set(ylabel="seconds", title="training time")
    axes[1].bar(names, [r["speedup vs 1 rank"] for r in ran], color="tab:green")
    top = max(r["ranks"] for r in ran)
    axes[1].axhline(top, color="gray", ls=":", lw=1)
    axes[1].text(-0.4, top * 1.02, f"{top} ranks: the most an honest speedup can be", fontsize=8, color="gray")
    axes[1].set(ylabel="x", title="speedup over the same program on 1 rank", ylim=(0, top * 1.25))
    width = 0.4
    xs = range(len(ran))
    axes[2].bar([x - width / 2 for x in xs], [r["peak MB / rank"] for r in ran], width, label="peak (process)")
    axes[2].bar([x + width / 2 for x in xs], [r["model states MB / rank"] for r in ran], width, label="model states")
    axes[2].set_xticks(list(xs), names)
    peak = max(r["peak MB / rank"] for r in ran)
    axes[2].set(ylabel="MB per rank", title="memory per rank", ylim=(0, peak * 1.3))  # headroom: the legend
    axes[2].legend(fontsize=8, loc="upper center", ncol=2)
    if refused:
        fig.text(0.5, -0.02, "not run on this machine (refused, or replaced by another strategy): "
                 + ", ".join(refused), ha="center", fontsize=9)
    fig.tight_layout()
    return fig


def plot_fsdp_timeline(events: Sequence[tuple]):
    """One FSDP2 step as it happened on rank 0: each unit's forward and backward beginning, and the
    all-gathers and reduce-scatters around them, bytes as bar heights (from frameworks_inside)."""
    fig, ax = plt.subplots(figsize=(11, 3.2))
    colours = {"all_gather": "tab:blue", "reduce_scatter": "tab:red", "all_reduce": "tab:purple"}
    for i, (kind, what, nbytes) in enumerate(events):
        if kind == "collective":
            ax.bar(i, nbytes / 1e3, color=colours.get(what, "gray"), label=what)
        else:
            ax.axvline(i, color="black" if kind == "forward" else "tab:orange", lw=1, ls="--")
            ax.text(i, 0.02, f" {kind} {what}", rotation=90, va="bottom", fontsize=8,  # beside its line,
                    transform=ax.get_xaxis_transform(),  # just above the axis (x in data, y in axes units)
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})  # readable over a bar
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside
    ax.set(xlabel="event, in order", ylabel="KB per collective", title="one FSDP2 step on rank 0")
    ax.set_xticks([])
    fig.tight_layout()
    return fig
