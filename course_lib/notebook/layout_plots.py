"""Training runs under several dp x pp x cp x tp layouts, side by side (notebook 10).

    from course_lib.notebook.layout_plots import layout_table, plot_layouts
    plot_layouts({"tp2-pp2": "runs/tp2-pp2", "dp4": "runs/dp4"})

Each run directory is the trainer's: ``metrics.csv`` (per step: the loss and, for model-parallel
runs, the most over ranks of memory, bytes per group and the bubble), ``ranks.json`` (the last
logged step's figures of every rank) and ``run.json`` (the layout).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from course_lib.analysis.parallel_comm import sent_bytes_per_step
from course_lib.hardware import MB
from course_lib.trainer.metrics import read_metrics

GROUPS = ("tp", "sp", "cp", "pp", "dp")


def _load(run_dir) -> dict:
    run_dir = Path(run_dir)
    ranks_file = run_dir / "ranks.json"
    return {"rows": read_metrics(run_dir / "metrics.csv"),
            "ranks": json.loads(ranks_file.read_text())["ranks"] if ranks_file.exists() else [],
            "info": json.loads((run_dir / "run.json").read_text())}


def layout_table(runs: dict[str, str | Path]):
    """One row per run: final losses, ms/iter, the bubble, memory per rank and bytes per group
    per step (the most over ranks); a pandas DataFrame. The ``*_MB`` columns are in MB (1e6 bytes, ``hardware.MB``)."""
    out = []
    for name, run_dir in runs.items():
        r = _load(run_dir)
        steps = [row for row in r["rows"] if not math.isnan(row.get("train_loss", math.nan))]
        last = steps[-1] if steps else {}
        evals = [row for row in r["rows"] if not math.isnan(row.get("val_loss", math.nan))]
        ranks = r["ranks"] or [{}]  # plain data parallelism writes no per-rank figures: NaN
        entry = {"layout": name, "ranks": r["info"]["world_size"], "train_loss": last.get("train_loss"),
                 "val_loss": evals[-1]["val_loss"] if evals else None,
                 "step_ms": sorted(s["step_ms"] for s in steps)[len(steps) // 2] if steps else None,
                 "bubble": last.get("bubble"), "bubble_theory": last.get("bubble_theory"),
                 "model_states_MB": max(x.get("model_state_bytes", math.nan) for x in ranks) / MB,
                 "activations_MB": max(x.get("peak_activation_bytes", math.nan) for x in ranks) / MB}
        entry.update({f"{g}_MB": max(x.get(f"sent_bytes_{g}", math.nan) for x in ranks) / MB for g in GROUPS})
        out.append(entry)
    return pd.DataFrame(out).set_index("layout")


def plot_layouts(runs: dict[str, str | Path]):
    """Loss curves on top of each other; memory per rank and bytes per group per step, per layout."""
    # pyplot only when drawing: importing it picks a backend
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem, ax_bytes) = plt.subplots(1, 3, figsize=(16, 4.2))
    for name, run_dir in runs.items():
        rows = [x for x in _load(run_dir)["rows"] if not math.isnan(x.get("train_loss", math.nan))]
        ax_loss.plot([x["iter"] for x in rows], [x["train_loss"] for x in rows], label=name, alpha=0.8)
    ax_loss.set(xlabel="iteration", ylabel="train loss", title="the same training, every layout")
    ax_loss.legend(fontsize=8)
    table = layout_table(runs)
    names = list(table.index)
    x = range(len(names))
    ax_mem.bar([i - 0.2 for i in x], table["model_states_MB"], width=0.4, label="model states")
    ax_mem.bar([i + 0.2 for i in x], table["activations_MB"], width=0.4, label="activations (peak)")
    ax_mem.set(ylabel="MB on the fullest rank", title="memory per rank")  # the table's MB: 1e6 bytes
    bottom = [0.0] * len(names)
    for g in GROUPS:
        values = table[f"{g}_MB"].fillna(0.0)
        ax_bytes.bar(x, values, bottom=bottom, label=g)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_bytes.set(ylabel="MB sent per step (busiest rank)", title="communication per group")
    # plain data parallelism (no tp/pp/cp) writes no per-rank figures: say so instead of an empty slot
    for i, missing in enumerate(table["model_states_MB"].isna()):
        for ax in (ax_mem, ax_bytes) if missing else ():
            ax.text(i, 0.02, "not recorded\n(plain data parallel)", rotation=90, ha="center", va="bottom",
                    fontsize=7, color="gray", transform=ax.get_xaxis_transform())
    for ax in (ax_mem, ax_bytes):
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(names) - 0.4)  # a slot for every layout, the unrecorded ones too
        ax.set_ylim(0, ax.get_ylim()[1] * 1.35)  # headroom: the legend sits above the tallest bar
        ax.legend(fontsize=8, loc="upper left", ncol=2 if ax is ax_mem else len(GROUPS))
    fig.tight_layout()
    return fig


def comm_model_table(runs: dict[str, str | Path], vocab_size: int):
    """Per layout and group, the bytes :func:`course_lib.analysis.parallel_comm.sent_bytes_per_step`
    predicts for the first pipeline stage next to what its rank 0 sent (``ranks.json``); plain
    data-parallel runs write no per-rank figures and are left out."""
    rows = []
    for name, run_dir in runs.items():
        if not (Path(run_dir) / "ranks.json").exists():
            continue
        cfg = json.loads((Path(run_dir) / "config.json").read_text())
        run = _load(run_dir)
        lay = run["info"]["layout"]
        zero = int(cfg["strategy"][-1]) if cfg["strategy"].startswith("zero") else 0
        want = sent_bytes_per_step(cfg["n_layer"], cfg["n_embd"], vocab_size, cfg["block_size"], cfg["bias"],
                                   cfg["batch_size"], cfg["gradient_accumulation_steps"], dp=lay["dp"], tp=lay["tp"],
                                   pp=lay["pp"], cp=lay["cp"], sequence_parallel=lay["sequence_parallel"],
                                   pp_rank=0, zero_stage=zero)
        rows += [{"layout": name, "group": group, "model MB": b / MB,
                  "measured MB": run["ranks"][0][f"sent_bytes_{group}"] / MB} for group, b in want.items()]
    return pd.DataFrame(rows).set_index(["layout", "group"])
