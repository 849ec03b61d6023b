"""A loss plot that redraws while the model trains (notebooks 7 and 8).

    from course_lib.notebook.live_plot import train_live
    summary = train_live(cfg)        # shows the plot, trains cfg, returns the run's summary

    plot = LiveLossPlot("runs/x/metrics.csv", total_iters=2000)
    plot                             # a notebook cell ending in it shows the widget
    plot.follow(some_function, ...)  # call it here while a thread keeps re-reading the file

The trainer writes one row of ``metrics.csv`` per logged step and flushes it at once
(:mod:`course_lib.trainer.metrics`), so following that file works for every way of training: in this
process, or on N ranks under torchrun, where only rank 0 writes. The plot polls the file from a
background thread while the training runs in the foreground, so the stop button still
interrupts the training, and it redraws only when a new row has arrived.

A saved notebook keeps the final plot: the output carries a static copy of the widget
(:mod:`course_lib.notebook.static`), and :func:`train_live` refreshes it when the run ends.

The widget (CSS class ``course-live-loss``) has a *smoothing* slider: an exponential moving
average of the logged train loss, debiased at the start as TensorBoard does, drawn over the raw
curve. Logged losses are noisy (one batch each); the average shows the trend, the evaluations
(val loss over ``eval_iters`` global batches) are the numbers to trust.
"""

from __future__ import annotations

import io
import json
import math
import os
import threading
from collections.abc import Callable, Sequence
from html import escape
from pathlib import Path

import ipywidgets as w
from IPython.display import display
from matplotlib.figure import Figure  # no pyplot: no global figure state

from course_lib.notebook.plots import plot_loss_curve
from course_lib.notebook.static import snapshot_bundle
from course_lib.trainer.metrics import read_metrics


def ema(values: Sequence[float], smoothing: float) -> list[float]:
    """Exponential moving average with weight ``smoothing`` on the past (0 = no smoothing).

    Debiased like TensorBoard's scalar smoothing: the average starts at zero, so each value is
    divided by the total weight seen so far (Kingma and Ba 2015, Adam, Sec. 3, the same
    correction); without it the first points would be pulled towards zero.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = smoothing * acc + (1.0 - smoothing) * v
        weight = smoothing * weight + (1.0 - smoothing)
        out.append(acc / weight)
    return out


def read_rows(path: str | os.PathLike) -> list[dict] | None:
    """The rows of a metrics.csv being written, or None if it cannot be read right now (not yet
    created, or a row half-written at this instant: the next poll reads it whole)."""
    try:
        return read_metrics(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _valid(rows: Sequence[dict], key: str) -> list[tuple[int, float]]:
    return [(r["iter"], r[key]) for r in rows if not math.isnan(r.get(key, math.nan))]


def status_html(rows: Sequence[dict], total_iters: int | None, smoothing: float, title: str = "") -> str:
    """One line under the slider: where the run is and its latest numbers."""
    head = f"<b>{escape(title)}</b> " if title else ""
    train, val = _valid(rows, "train_loss"), _valid(rows, "val_loss")
    if not train and not val:
        return f'<div class="course-live-loss-status">{head}waiting for the first metrics row...</div>'
    last = rows[-1]["iter"]
    parts = [f"iter {last:,}" + (f" / {total_iters:,}" if total_iters else "")]
    if train:
        smoothed = ema([v for _, v in train], smoothing)[-1]
        parts.append(f"train loss {train[-1][1]:.4f} (smoothed {smoothed:.4f})")
    if val:
        best = min(v for _, v in val)
        parts.append(f"val loss {val[-1][1]:.4f} at iter {val[-1][0]:,} (best {best:.4f})")
    speed = _valid(rows, "tokens_per_s")
    if speed:
        step_ms = _valid(rows, "step_ms")[-1][1]
        parts.append(f"{speed[-1][1]:,.0f} tokens/s, {step_ms:.1f} ms/iter")
    return f'<div class="course-live-loss-status">{head}' + " &middot; ".join(parts) + "</div>"


def loss_figure(rows: Sequence[dict], smoothing: float = 0.0, title: str | None = None,
                total_iters: int | None = None, ax=None):
    """The loss curves of a run (course_lib.notebook.plots.plot_loss_curve) plus the smoothed train loss."""
    if ax is None:
        ax = Figure(figsize=(7, 4), layout="constrained").add_subplot()
    fig = ax.figure
    if not _valid(rows, "train_loss") and not _valid(rows, "val_loss"):
        ax.text(0.5, 0.5, "waiting for the first metrics row...", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_title(title or "Training loss")
        return fig
    plot_loss_curve(rows, title=title, ax=ax)
    train = _valid(rows, "train_loss")
    if smoothing > 0 and len(train) > 1:
        iters, values = zip(*train)
        ax.lines[0].set_alpha(0.3)
        ax.plot(iters, ema(values, smoothing), color=ax.lines[0].get_color(), linewidth=2,
                label=f"train loss, smoothed ({smoothing:.2f})")
        ax.legend(fontsize=8)
    if total_iters:
        ax.set_xlim(0, total_iters)
    return fig


class LiveLossPlot:
    """A widget that follows ``metrics_csv``: smoothing slider, status line, loss plot.

    ``poll()`` re-reads the file and redraws if it changed; ``follow(fn, ...)`` runs ``fn`` in
    this thread while a background thread polls every ``interval_s`` seconds. ``history`` holds
    the number of rows at each redraw (how live the plot was).
    """

    def __init__(self, metrics_csv: str | os.PathLike, total_iters: int | None = None, title: str = "",
                 smoothing: float = 0.6, interval_s: float = 1.0, figsize=(7.5, 3.6), dpi: int = 80):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        ema([], smoothing)  # validates
        self.path = Path(metrics_csv)
        self.total_iters, self.title, self.interval_s = total_iters, title, interval_s
        self.figsize, self.dpi = figsize, dpi
        self.rows: list[dict] = []
        self._signature = None
        self.history: list[int] = []
        self._lock = threading.Lock()  # the polling thread and the slider both redraw
        self.slider = w.FloatSlider(value=smoothing, min=0.0, max=0.95, step=0.01, description="smoothing",
                                    readout_format=".2f", continuous_update=False)
        self.status = w.HTML()
        self.image = w.Image(format="png")
        self.widget = w.VBox([self.slider, self.status, self.image])
        self.widget.add_class("course-live-loss")
        self.slider.observe(lambda change: self.redraw(), names="value")
        self.redraw()

    @property
    def smoothing(self) -> float:
        return self.slider.value

    def poll(self) -> bool:
        """Re-read the metrics file; redraw and return True if it has new rows."""
        try:
            stat = self.path.stat()
        except OSError:
            return False  # not created yet
        signature = (stat.st_size, stat.st_mtime_ns)  # rows are appended (or the file rewritten)
        if signature == self._signature:
            return False
        rows = read_rows(self.path)
        if rows is None:
            return False
        self.rows, self._signature = rows, signature
        self.redraw()
        return True

    def redraw(self) -> None:
        with self._lock:
            rows = list(self.rows)
            fig = loss_figure(rows, self.smoothing, self.title or None, self.total_iters)
            fig.set_size_inches(*self.figsize)
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=self.dpi)
            self.image.value = buf.getvalue()  # the plot first: a changed status means both are new
            self.status.value = status_html(rows, self.total_iters, self.smoothing, self.title)
            self.history.append(len(rows))

    def follow(self, fn: Callable, *args, **kwargs):
        """Return ``fn(*args, **kwargs)``, polling the file in the background meanwhile."""
        stop = threading.Event()
        errors: list[BaseException] = []

        def loop() -> None:
            while not stop.wait(self.interval_s):
                try:
                    self.poll()
                except Exception as e:  # noqa: BLE001 - reported after fn returns, not lost
                    errors.append(e)
                    return

        thread = threading.Thread(target=loop, name="course-live-loss", daemon=True)
        thread.start()
        try:
            return fn(*args, **kwargs)
        finally:
            stop.set()
            thread.join()
            self.poll()  # the final rows
            if errors:
                raise RuntimeError(f"the live plot stopped updating: {errors[0]!r}") from errors[0]

    def _repr_mimebundle_(self, **kwargs):
        """The widget, plus its current status and plot as static HTML (what a saved notebook shows)."""
        with self._lock:
            return snapshot_bundle(self.widget)


def train_live(cfg, *, overwrite: bool = False, interval_s: float = 1.0, plot: LiveLossPlot | None = None,
               progress: bool = True, **launch_kwargs) -> dict:
    """Train ``cfg`` (a course_lib.trainer.config.TrainConfig) with a live loss plot; returns its summary.

    The request is checked first (:func:`course_lib.launch.checks.check_request`: ``overwrite``
    restarts a run that is there; ``cfg.init_from == "resume"`` continues it, and the plot shows its
    earlier rows too). One process (``cfg.nproc == 1``, strategy single) then trains right here
    (:func:`course_lib.launch.training.train_in_process`); more are launched with
    :func:`course_lib.launch.launch_training` (extra keyword arguments go to it). Either clears an
    overwritten run only once every check has passed, its keyword arguments' too: a refused call
    leaves the old run as it was.
    """
    # why: the trainer and the launcher import torch; the plot alone needs neither
    from course_lib.launch.checks import check_request
    from course_lib.launch.training import launch_training, train_in_process

    # clear errors before anything is shown or started; nproc/nnodes given here count as launch_training's
    req = check_request(cfg, nproc=launch_kwargs.get("nproc"), nnodes=launch_kwargs.get("nnodes", 1),
                        overwrite=overwrite)
    if req.world_size == 1 and req.strategy == "single" and launch_kwargs:
        raise TypeError(f"train_live trains one process right here: {', '.join(sorted(launch_kwargs))} "
                        "would go to launch_training, which runs only for nproc > 1")
    handle = None
    if plot is None:
        plot = LiveLossPlot(Path(cfg.out_dir) / "metrics.csv", cfg.max_iters, cfg.name, interval_s=interval_s)
        handle = display(plot, display_id=True)
    try:
        if req.world_size == 1 and req.strategy == "single":
            return plot.follow(train_in_process, req.config, overwrite=overwrite, progress=progress)
        plot.follow(launch_training, req.config, progress=progress, check=True, overwrite=overwrite,
                    **launch_kwargs)
        return json.loads((Path(cfg.out_dir) / "summary.json").read_text())
    finally:
        if handle is not None:  # the saved output: the last plot and status, not the first
            handle.update(plot)
