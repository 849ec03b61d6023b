"""The experts lesson's figures (notebook 13): the all-to-all of a real routing, tokens per expert
over training, expert against data parallelism per rank.

    from course_lib.notebook.moe_plots import plot_all_to_all, plot_tokens_per_expert, plot_ep_against_dp
    plot_all_to_all(counts)            # counts[r][s]: rows rank r sends to rank s (experiments.moe_runs.routing_counts)
    plot_tokens_per_expert({"run": history})   # experiments.moe_runs.router_history
    plot_ep_against_dp(rows)                 # experiments.moe_runs.measured_rows
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle
from matplotlib.ticker import MaxNLocator


def plot_all_to_all(counts: Sequence[Sequence[int]], title: str = "dispatch"):
    """Each rank's send buffer (left: its rows grouped by the rank that holds their expert) and
    receive buffer (right: the rows every rank sent it, rank 0's first), with an arrow per block;
    the block widths are the counts, so an unbalanced router shows as uneven blocks. The combine
    is the same picture read from right to left."""
    c = np.asarray(counts, dtype=float)
    p = len(c)
    colours = plt.get_cmap("tab10")
    width = max(c.sum(1).max(), c.sum(0).max())
    gap = 0.6 * width
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.75 * p))
    for r in range(p):
        y = p - 1 - r
        x = 0.0  # send buffer of rank r: blocks for s = 0..p-1
        for s in range(p):
            ax.add_patch(Rectangle((x, y), c[r, s], 0.6, color=colours(s), alpha=0.85, lw=0.5, ec="white"))
            if c[r, s]:
                ax.text(x + c[r, s] / 2, y + 0.3, f"{int(c[r, s])}", ha="center", va="center", fontsize=8)
            x += c[r, s]
        x = width + gap  # receive buffer of rank r: blocks from s = 0..p-1
        for s in range(p):
            ax.add_patch(Rectangle((x, y), c[s, r], 0.6, color=colours(r), alpha=0.35 + 0.5 * (s == r),
                                   lw=0.5, ec="white", hatch=None if s == r else "//"))
            if c[s, r]:  # the source under the count where the block has room for it
                label = f"{int(c[s, r])}\nfrom {s}" if c[s, r] >= 0.07 * width else f"{int(c[s, r])}"
                ax.text(x + c[s, r] / 2, y + 0.3, label, ha="center", va="center", fontsize=7)
            x += c[s, r]
        ax.text(-0.02 * width, y + 0.3, f"rank {r}", ha="right", va="center", fontsize=9)
    for r in range(p):  # arrows from block (r -> s) on the left to its place on the right
        for s in range(p):
            if not c[r, s] or r == s:
                continue
            x0 = c[r, :s].sum() + c[r, s] / 2
            x1 = width + gap + c[:r, s].sum() + c[r, s] / 2
            ax.add_patch(FancyArrowPatch((x0, p - 1 - r), (x1, p - 1 - s + 0.6), arrowstyle="-|>",
                                         mutation_scale=8, color=colours(s), alpha=0.5,
                                         lw=0.5 + 2.5 * c[r, s] / c.max(), connectionstyle="arc3,rad=0.0"))
    sent = c.sum() - np.trace(c)
    ax.set_xlim(-0.15 * width, 2 * width + gap + 0.02 * width)
    ax.set_ylim(-0.3, p)
    ax.axis("off")
    ax.text(width / 2, p - 0.15, "send buffers: rows grouped by the rank of their expert", ha="center", fontsize=9)
    ax.text(width + gap + width / 2, p - 0.15, "receive buffers: what each rank's experts compute",
            ha="center", fontsize=9)
    ax.set_title(f"{title}: one all_to_all_single, {int(c.sum())} rows, {int(sent)} of them leave their "
                 f"rank ({sent / max(c.sum(), 1):.0%}; an even router sends (p-1)/p = {(p - 1) / p:.0%})", fontsize=10)
    fig.tight_layout()
    return fig


def plot_tokens_per_expert(runs: Mapping[str, Mapping]):
    """One column per run (``experiments.moe_runs.router_history``): the share of the assignments
    each expert got per logged step (summed over the blocks), the even share 1/E dashed; below,
    the busiest expert's load over the mean (1 = even; the step waits for the busiest)."""
    fig, axes = plt.subplots(2, len(runs), figsize=(4.6 * len(runs) + 0.6, 5.2), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1]}, sharey="row")
    colours = plt.get_cmap("tab10")
    top_share = max(max(max(r) / max(sum(r), 1) for r in h["tokens_per_expert"]) for h in runs.values())
    for i, (name, history) in enumerate(runs.items()):
        steps = list(history["steps"])
        counts = np.asarray(history["tokens_per_expert"], dtype=float)  # (steps, E)
        E = counts.shape[1]
        share = counts / np.maximum(counts.sum(-1, keepdims=True), 1)
        top, bottom = axes[0, i], axes[1, i]
        for e in range(E):
            top.plot(steps, share[:, e], color=colours(e % 10), lw=1.4, label=f"expert {e}")
        top.axhline(1 / E, color="gray", ls="--", lw=1)
        top.set(title=name, ylim=(0, min(1, top_share * 1.15 + 0.02)))
        bottom.plot(steps, share.max(-1) * E, color="black", lw=1.2)
        bottom.axhline(1, color="gray", ls="--", lw=1)
        bottom.set(xlabel="step", ylim=(0.9, max(2, float((share.max(-1) * E).max()) * 1.1)))
        for ax in (top, bottom):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axes[0, 0].set_ylabel("share of the assignments")
    axes[1, 0].set_ylabel("busiest / mean")
    axes[0, 0].legend(fontsize=7, ncol=2)
    fig.suptitle("the router at work: tokens per expert over training, all blocks (dashed: 1/E, an even split)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_ep_against_dp(rows: Sequence[Mapping]):
    """Expert against data parallelism, per rank: model states measured (bars) and modelled
    (analysis.moe_memory, black ticks), step time, and bytes sent by the all-to-alls and the
    gradient all-reduces."""
    names = [r["layout"] for r in rows]
    xs = np.arange(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(xs, [r["states MB"] for r in rows], color="tab:blue", label="measured")
    axes[0].scatter(xs, [r["model MB"] for r in rows], marker="_", s=900, color="black", zorder=3,
                    label="analysis.moe_memory")
    axes[0].set(ylabel="MB per rank", title="model states per rank")
    axes[0].legend(fontsize=8, markerscale=0.3)  # the tick at its plotted size would run past the frame
    axes[1].bar(xs, [r["step ms"] for r in rows], color="tab:green")
    axes[1].set(ylabel="ms", title="one training step (median)")
    w = 0.4
    axes[2].bar(xs - w / 2, [r["all_to_all MB"] for r in rows], w, color="tab:orange", label="all-to-all")
    axes[2].bar(xs + w / 2, [r["all_reduce MB"] for r in rows], w, color="tab:purple", label="gradient all-reduce")
    axes[2].set(ylabel="MB sent per rank and step", title="communication per rank")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(xs, names, fontsize=8)
    fig.tight_layout()
    return fig
