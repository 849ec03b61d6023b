"""course_lib.notebook.live_plot: the loss plot that follows metrics.csv while a run trains.

The smoothing is TensorBoard's debiased exponential moving average; the plot must redraw while
the training function is still running (not only at its end), show what the file holds, and
the trainer run through train_live must end with the plot holding exactly its metrics.csv.
"""

from __future__ import annotations

import threading
import time

import pytest

from course_lib.launch.placement import LaunchConfigError
from course_lib.notebook.live_plot import LiveLossPlot, ema, status_html, train_live
from course_lib.registry import ConfigError
from course_lib.trainer.config import make_config
from course_lib.trainer.metrics import MetricsWriter, read_metrics


def test_ema():
    assert ema([3.0, 1.0, 2.0], 0.0) == [3.0, 1.0, 2.0]
    assert ema([2.0] * 5, 0.9) == pytest.approx([2.0] * 5)  # debiased: a constant stays constant
    # by hand: acc = 0.5 * 4 = 2, w = 0.5 -> 4; acc = 0.5 * 2 + 0.5 * 2 = 2, w = 0.75 -> 2.667
    assert ema([4.0, 2.0], 0.5) == pytest.approx([4.0, 8 / 3])
    with pytest.raises(ValueError, match="smoothing"):
        ema([1.0], 1.0)


def _row(it, loss, val=None):
    row = {"iter": it, "train_loss": loss, "lr": 1e-3, "step_ms": 10.0, "tokens_per_s": 1000.0}
    if val is not None:
        row["val_loss"] = val
    return row


def test_poll_follows_the_file_and_smoothing_changes_the_status(tmp_path):
    path = tmp_path / "metrics.csv"
    plot = LiveLossPlot(path, total_iters=100, title="t")
    assert plot.poll() is False and "waiting" in plot.status.value  # no file yet
    writer = MetricsWriter(path)
    writer.write(_row(0, 4.0, val=4.1))
    assert plot.poll() is True and plot.poll() is False  # redraws only when something is new
    for it, loss in [(1, 3.0), (2, 3.5), (3, 2.0)]:
        writer.write(_row(it, loss))
    assert plot.poll() is True
    assert [r["iter"] for r in plot.rows] == [0, 1, 2, 3]
    text = plot.status.value
    assert "iter 3 / 100" in text and "train loss 2.0000" in text and "val loss 4.1000 at iter 0" in text
    assert f"smoothed {ema([4.0, 3.0, 3.5, 2.0], 0.6)[-1]:.4f}" in text
    image = plot.image.value
    assert image[:8] == b"\x89PNG\r\n\x1a\n"
    plot.slider.value = 0.2  # what the browser test does with the mouse
    assert plot.status.value != text and f"smoothed {ema([4.0, 3.0, 3.5, 2.0], 0.2)[-1]:.4f}" in plot.status.value
    assert plot.image.value != image


def test_follow_redraws_while_the_function_runs(tmp_path):
    """The function writes rows one by one and waits until the plot has drawn each: only a
    plot that polls during the call lets it finish."""
    path = tmp_path / "metrics.csv"
    plot = LiveLossPlot(path, interval_s=0.02)

    def fake_training(n: int) -> str:
        writer = MetricsWriter(path)
        for it in range(n):
            writer.write(_row(it, 4.0 - 0.1 * it))
            deadline = time.monotonic() + 20
            while len(plot.rows) < it + 1:
                assert time.monotonic() < deadline, "the plot did not redraw during the call"
                time.sleep(0.01)
        return "done"

    assert plot.follow(fake_training, 5) == "done"
    assert [h for h in plot.history if h] == [1, 2, 3, 4, 5]
    assert not [t for t in threading.enumerate() if t.name == "course-live-loss"]  # thread stopped

    def fails():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        plot.follow(fails)
    assert not [t for t in threading.enumerate() if t.name == "course-live-loss"]


def test_status_without_rows():
    assert "waiting" in status_html([], 10, 0.5)


@pytest.mark.timeout(240)
def test_train_live_in_process(tmp_path):
    cfg = make_config("shakespeare_char_cpu", {
        "out_dir": str(tmp_path / "run"), "max_iters": 12, "eval_interval": 6, "eval_iters": 2,
        "log_interval": 1, "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 4,
        "warmup_iters": 2, "lr_decay_iters": 12, "threads": 1})
    plot = LiveLossPlot(tmp_path / "run" / "metrics.csv", cfg.max_iters, interval_s=0.05)
    summary = train_live(cfg, plot=plot, progress=False)
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert summary["iters"] == 12 and summary["val_loss"] == pytest.approx(rows[-1]["val_loss"])
    assert repr(plot.rows) == repr(rows) and plot.history[-1] == len(rows)  # repr: NaN == NaN
    assert "iter 12 / 12" in plot.status.value
    with pytest.raises(ConfigError, match="already holds a run"):  # refused before anything runs
        train_live(cfg, plot=plot, progress=False)
    # overwrite=True with a keyword that is then refused: the finished run is still all there
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    with pytest.raises(TypeError, match="one process right here"):  # it would have been ignored
        train_live(cfg, plot=plot, progress=False, overwrite=True, timeout=60)
    with pytest.raises(LaunchConfigError, match="grace"):  # 2 ranks: launch() refuses it before its start
        train_live(cfg.replace(nproc=2), plot=plot, progress=False, overwrite=True, grace=None)
    with pytest.raises(TypeError, match="unknown field"):
        train_live(cfg.replace(nproc=2), plot=plot, progress=False, overwrite=True, graze=1.0)
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()} == before
    assert "last.pt" in before and "metrics.csv" in before


@pytest.mark.slow  # a Jupyter kernel: ~5 s alone, ~20 s on a busy machine
@pytest.mark.timeout(240)
def test_a_saved_notebook_keeps_the_final_plot_and_progress_line(tmp_path, monkeypatch):
    """Run train_live in a real Jupyter kernel and read the outputs it leaves in the notebook:
    the last plot and status (not the first) as static HTML, and the finished progress line."""
    import nbformat

    from course_lib.exercises.runner import NotebookRunner
    from course_lib.notebook.static import WIDGET_VIEW
    from course_lib.utils import repo_root

    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    out = tmp_path / "run"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "from course_lib.trainer.config import make_config\n"
        "from course_lib.notebook.live_plot import train_live\n"
        f"cfg = make_config('shakespeare_char_cpu', {{'out_dir': {str(out)!r}, 'max_iters': 12, 'eval_interval': 6,\n"
        "    'eval_iters': 2, 'log_interval': 1, 'n_layer': 1, 'n_head': 2, 'n_embd': 32, 'block_size': 32,\n"
        "    'batch_size': 4, 'warmup_iters': 2, 'lr_decay_iters': 12, 'threads': 1})\n"
        "summary = train_live(cfg, interval_s=0.05)")]
    NotebookRunner(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(repo_root())}}).execute()
    outputs = [o for o in nb.cells[0].outputs if o.output_type == "display_data"]
    plots = [o for o in outputs if "course-live-loss-status" in o.data.get("text/html", "")]
    bars = [o for o in outputs if o is not plots[0] and WIDGET_VIEW in o.data]
    assert len(plots) == 1 and len(bars) == 1, [list(o.data) for o in outputs]
    html = plots[0].data["text/html"]
    assert WIDGET_VIEW in plots[0].data and "iter 12 / 12" in html and 'src="data:image/png;base64,' in html
    assert "VBox(" not in plots[0].data["text/plain"]
    line = bars[0].data["text/plain"]
    assert "100%" in line and "12/12" in line, line  # the finished bar, not "0%| 0/12"
