"""Notebook 10's layout table and figure: memory and bytes per group per layout, and an empty slot
explained, never silent, for plain data parallelism (which writes no per-rank figures).

    python -m pytest tests/test_layout_plots.py -q
"""

from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")

from course_lib.notebook.layout_plots import layout_table, plot_layouts  # noqa: E402


def _run(path, world_size, ranks=None):
    path.mkdir()
    (path / "metrics.csv").write_text("iter,train_loss,val_loss,step_ms\n0,,4.2,\n1,4.1,,50\n2,4.0,,52\n3,3.9,,51\n")
    (path / "run.json").write_text(json.dumps({"world_size": world_size}))
    if ranks is not None:
        (path / "ranks.json").write_text(json.dumps({"ranks": ranks}))
    return path


def test_table_takes_the_fullest_rank_and_the_figure_explains_a_missing_one(tmp_path):
    mb = 1e6  # the table's MB (hardware.MB)
    runs = {"dp2": _run(tmp_path / "dp2", 2),
            "tp2": _run(tmp_path / "tp2", 2, [
                {"model_state_bytes": 3 * mb, "peak_activation_bytes": 5 * mb, "sent_bytes_tp": 2 * mb},
                {"model_state_bytes": 4 * mb, "peak_activation_bytes": 6 * mb, "sent_bytes_tp": 1 * mb}])}
    table = layout_table(runs)
    assert table.loc["tp2", "model_states_MB"] == 4 and table.loc["tp2", "activations_MB"] == 6
    assert table.loc["tp2", "tp_MB"] == 2 and math.isnan(table.loc["tp2", "dp_MB"])
    assert table.loc["tp2", "step_ms"] == 51 and table.loc["tp2", "train_loss"] == 3.9
    assert math.isnan(table.loc["dp2", "model_states_MB"])
    fig = plot_layouts(runs)
    notes = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert notes.count("not recorded\n(plain data parallel)") == 2  # memory and bytes panels, dp2 only
