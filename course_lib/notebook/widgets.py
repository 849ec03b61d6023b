"""Interactive widgets for the notebooks: the training-memory calculator of notebook 4.

    from course_lib.notebook.widgets import memory_calculator
    calc = memory_calculator(model="gpt2-xl", dp=8, gpu="a100-40gb")
    calc                      # the cell's last line shows it; move a control and it recomputes
    calc.result.total         # bytes per device for the current settings

Nothing is built on import: ipywidgets and matplotlib are imported when a calculator is made.
Every number comes from :func:`course_lib.analysis.memory.breakdown` (model states after Rajbhandari et
al. 2020, activations after Korthikanti et al. 2022); the widget only collects the settings and
shows the result: a table, a verdict against the chosen GPU and the four ZeRO stages as bars
(:func:`course_lib.notebook.plots.plot_memory`). The calculation is split from the widgets
(:func:`calculate`) so tests and scripts can use it without a browser.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from html import escape

from course_lib.analysis.memory import (
    GB,
    PRESETS,
    STAGE_NAMES,
    STAGES,
    MemoryBreakdown,
    breakdown,
    resolve_gpu,
)
from course_lib.hardware import PROFILES
from course_lib.notebook.static import snapshot_bundle

CUSTOM = "custom"  # the model choice "give a parameter count" (model states only)
DP_CHOICES = tuple(2**i for i in range(11))  # 1, 2, 4, ..., 1024 data-parallel ranks
DTYPE_CHOICES = (("mixed precision (16-bit weights, fp32 Adam)", "mixed"),
                 ("torch.autocast (fp32 weights, 16-bit activations)", "autocast"), ("fp32", "fp32"))
RECOMPUTE_CHOICES = ("none", "selective", "full")
BATCH_MAX = 128  # the micro-batch slider's end
PARTS = ("params", "grads", "optimizer", "activations")


def gpu_choices() -> list[str]:
    """The hardware profiles that have a memory size (every GPU; not the CPU placeholder)."""
    return [name for name, p in PROFILES.items() if p.memory_bytes > 0]


@dataclass(frozen=True)
class Settings:
    """What the calculator's controls hold. ``params_b``: billions of parameters (custom only)."""

    model: str = "gpt2"
    params_b: float = 7.5
    dp: int = 1
    stage: int = 0
    dtype: str = "mixed"
    recompute: str = "none"
    batch_size: int | None = None  # None: the preset's micro-batch
    flash_attention: bool = False
    gpu: str = "a100-80gb"


@dataclass(frozen=True)
class Calculation:
    """One calculation: the breakdown for the chosen stage, all four stages, and the verdict."""

    settings: Settings
    breakdown: MemoryBreakdown
    stages: dict[int, MemoryBreakdown]
    gpu_name: str
    gpu_bytes: float

    @property
    def total(self) -> float:
        return self.breakdown.total

    @property
    def fits(self) -> bool:
        return self.breakdown.total <= self.gpu_bytes

    def advice(self) -> list[str]:
        """What would make it fit (empty when it fits): the cheapest change of one setting."""
        if self.fits:
            return []
        s, b, tips = self.settings, self.breakdown, []
        for stage in STAGES[s.stage + 1:]:
            if self.stages[stage].total <= self.gpu_bytes:
                tips.append(f"ZeRO stage {stage} fits ({self.stages[stage].total / GB:.3g} GB).")
                break
        if b.activations > 0 and s.recompute != "full":
            full = calculate(Settings(**{**s.__dict__, "recompute": "full"})).total
            if full <= self.gpu_bytes:
                tips.append(f"Full recomputation fits ({full / GB:.3g} GB).")
        if s.stage > 0:  # sharded states shrink with more ranks; the rest does not
            for dp in DP_CHOICES:
                if dp > s.dp and calculate(Settings(**{**s.__dict__, "dp": dp})).fits:
                    tips.append(f"{dp} data-parallel ranks fit at this stage.")
                    break
        if not tips:
            best = calculate(Settings(**{**s.__dict__, "stage": 3, "dp": DP_CHOICES[-1],
                                         "recompute": "full" if b.activations else s.recompute}))
            if best.fits:
                tips.append("No single change is enough: combine ZeRO-3, more ranks and recomputation.")
            else:
                tips.append(f"Even ZeRO-3 on {DP_CHOICES[-1]} ranks with full recomputation needs "
                            f"{best.total / GB:.3g} GB: use a smaller micro-batch, tensor or "
                            "pipeline parallelism, or offloading.")
        return tips


def calculate(settings: Settings) -> Calculation:
    """The calculator's numbers for ``settings`` (no widgets involved)."""
    if not isinstance(settings, Settings):
        raise TypeError(f"calculate takes a Settings, such as Settings(model='gpt2', dp=8), got {settings!r}")
    s = settings
    kwargs = {"dp": s.dp, "dtype": s.dtype, "recompute": s.recompute}
    if s.model == CUSTOM:
        if isinstance(s.params_b, bool) or not isinstance(s.params_b, (int, float)) or not s.params_b > 0:
            raise ValueError(f"the parameter count must be a number > 0 (billions), got {s.params_b!r}")
        what = {"num_params": s.params_b * 1e9}
    else:
        if s.model not in PRESETS:
            raise ValueError(f"unknown model {s.model!r}; choose {CUSTOM!r} or one of: {', '.join(PRESETS)}")
        what = {"preset": s.model, "batch_size": s.batch_size, "flash_attention": s.flash_attention}
    chosen = breakdown(**what, stage=s.stage, **kwargs)  # a bad stage is refused here, by breakdown's check
    stages = {st: chosen if st == s.stage else breakdown(**what, stage=st, **kwargs) for st in STAGES}
    name, nbytes = resolve_gpu(s.gpu)
    return Calculation(s, chosen, stages, name, nbytes)


def summary_html(result: Calculation) -> str:
    """The table and verdict the calculator shows (numbers in GB = 1e9 bytes, as the paper)."""
    b, s = result.breakdown, result.settings
    rows = "".join(
        f'<tr><td>{part}</td><td class="num" data-part="{part}">{getattr(b, part) / GB:.3f}</td>'
        f'<td class="num">{100 * getattr(b, part) / b.total:.0f}%</td></tr>'
        for part in PARTS)
    psi = b.num_params
    model = f"{psi / 1e9:.3g} B parameters" if s.model == CUSTOM else \
        f"{s.model} ({psi / 1e6:.0f} M parameters, micro-batch {s.batch_size or PRESETS[s.model].batch_size})"
    if result.fits:
        verdict = (f'<b style="color:#1e8449">fits</b> on {escape(result.gpu_name)} '
                   f"({result.gpu_bytes / GB:.0f} GB): {(result.gpu_bytes - b.total) / GB:.3g} GB to spare")
    else:
        verdict = (f'<b style="color:#b03a2e">does not fit</b> on {escape(result.gpu_name)} '
                   f"({result.gpu_bytes / GB:.0f} GB): {(b.total - result.gpu_bytes) / GB:.3g} GB too much"
                   + "".join(f"<br/>&rarr; {escape(t)}" for t in result.advice()))
    note = "" if s.model != CUSTOM else \
        "<br/><i>A bare parameter count has no shape: activations are not included.</i>"
    return (f'<div class="course-memcalc-summary" data-total-gb="{b.total / GB:.6g}" '
            f'data-fits="{str(result.fits).lower()}">'
            f"<b>{escape(STAGE_NAMES[s.stage])}</b>, {escape(model)}, N<sub>d</sub> = {s.dp}, "
            f"{escape(s.dtype)}, recompute {escape(s.recompute)}"
            '<table style="margin:4px 0"><tr><th>per device</th><th>GB</th><th>share</th></tr>'
            f'{rows}<tr><td><b>total</b></td><td class="num" data-part="total"><b>{b.total / GB:.3f}</b>'
            f"</td><td></td></tr></table>{verdict}{note}</div>")


def stages_png(result: Calculation) -> bytes:
    """The four ZeRO stages as stacked bars with the GPU's memory as a line (PNG bytes)."""
    from course_lib.notebook.plots import plot_memory  # matplotlib only for the chart

    items = {STAGE_NAMES[st].split(" ")[0] + (" *" if st == result.settings.stage else ""): b
             for st, b in result.stages.items()}
    fig = plot_memory(items, result.gpu_bytes, f"{result.gpu_name} ({result.gpu_bytes / GB:.0f} GB)",
                      f"N_d = {result.settings.dp}; * = the stage you chose")
    fig.set_size_inches(5.0, 3.4)  # ~480 px wide at 96 dpi: the results column's width in a wide output
    ax = fig.axes[0]
    # off the bars, under the axis; 10 pt ~ 13 px at 96 dpi
    ax.legend(fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    ax.tick_params(labelsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    return buf.getvalue()


class MemoryCalculator:
    """The widget: controls on the left, the table, verdict and bar chart on the right (below the
    controls where the output area is too narrow for both).

    ``controls`` maps each :class:`Settings` field to its widget; setting a control's ``value``
    (in code or in the browser) recomputes ``result`` and redraws. ``widget`` is the ipywidgets
    box that is displayed.
    """

    def __init__(self, settings: Settings | None = None, plot: bool = True):
        import ipywidgets as w  # only the widget needs it: the numbers and the table import without

        s = settings or Settings()
        calculate(s)  # bad settings raise here, before any widget exists
        self.plot = plot
        style, layout = {"description_width": "130px"}, w.Layout(width="420px")
        buttons = {"description_width": "130px", "button_width": "80px"}
        row = w.Layout(width="480px")  # the label and all buttons on one row
        models = [(f"{name} ({PRESETS[name].num_params() / 1e6:.0f} M)", name) for name in PRESETS]
        self.controls = {
            "model": w.Dropdown(options=models + [("custom parameter count", CUSTOM)], value=s.model,
                                description="model", style=style, layout=layout),
            # a text box, not a log slider: a slider snaps 7.5 to its grid (10**0.88 = 7.586)
            "params_b": w.BoundedFloatText(value=s.params_b, min=0.001, max=10_000, step=0.1,
                                           description="Ψ (billions)", style=style, layout=layout),
            "dp": w.SelectionSlider(options=list(DP_CHOICES), value=s.dp, description="DP ranks N_d",
                                    style=style, layout=layout),
            "stage": w.ToggleButtons(options=[(STAGE_NAMES[st].split(" ")[0], st) for st in STAGES],
                                     value=s.stage, description="ZeRO stage", style=buttons, layout=row),
            "dtype": w.Dropdown(options=list(DTYPE_CHOICES), value=s.dtype, description="dtype",
                                style=style, layout=layout),
            "recompute": w.ToggleButtons(options=list(RECOMPUTE_CHOICES), value=s.recompute,
                                         description="recomputation", style=buttons, layout=row),
            "batch_size": w.IntSlider(value=s.batch_size or (PRESETS[s.model].batch_size if s.model in PRESETS else 8),
                                      min=1, max=BATCH_MAX, description="micro-batch", style=style, layout=layout),
            "flash_attention": w.Checkbox(value=s.flash_attention, description="fused (flash) attention",
                                          style=style, layout=layout),
            "gpu": w.Dropdown(options=gpu_choices(), value=s.gpu, description="GPU to fit on",
                              style=style, layout=layout),
        }
        for name in ("stage", "recompute"):  # ipywidgets 8 stacks a ToggleButtons' description above
            self.controls[name].add_class("widget-inline-hbox")  # its buttons; this puts it on their row
        self.summary = w.HTML()
        self.image = w.Image(format="png", layout=w.Layout(max_width="100%", height="auto"))  # fits its column
        # The controls keep their width (a squeezed column clips its labels and wraps each row of
        # buttons under its label); the results take the rest, at least 400 px, and go below the
        # controls where the output area is narrower than both
        controls = w.VBox(list(self.controls.values()), layout=w.Layout(flex="0 0 490px"))
        results = w.VBox([self.summary, self.image], layout=w.Layout(flex="1 1 400px", min_width="400px"))
        self.widget = w.HBox([controls, results], layout=w.Layout(flex_flow="row wrap"))
        self.widget.add_class("course-memcalc")
        self.result: Calculation | None = None
        for control in self.controls.values():
            control.observe(self._changed, names="value")
        self._last_model, self._syncing = s.model, True
        self._sync_size()
        self._syncing = False
        self.update()

    def settings(self) -> Settings:
        c = {name: control.value for name, control in self.controls.items()}
        return Settings(**c)

    def _changed(self, change) -> None:
        if self._syncing:  # one of our own changes below
            return
        model = self.controls["model"].value
        self._syncing = True
        try:
            if model != self._last_model and model in PRESETS:  # a new preset: its own micro-batch
                self.controls["batch_size"].value = PRESETS[model].batch_size
            self._sync_size()
        finally:
            self._syncing = False
        self._last_model = model
        self.update()

    def _sync_size(self) -> None:
        """A preset's parameter count is shown (greyed out) in the Ψ box: its exact size."""
        model = self.controls["model"].value
        if model in PRESETS:
            self.controls["params_b"].value = round(PRESETS[model].num_params() / 1e9, 4)

    def update(self) -> Calculation:
        """Recompute from the controls and redraw; returns the new result."""
        custom = self.controls["model"].value == CUSTOM
        self.controls["params_b"].disabled = not custom  # a preset's size comes from its shape
        for name in ("batch_size", "flash_attention", "recompute"):
            self.controls[name].disabled = custom  # activations need a shape
        self.result = calculate(self.settings())
        self.summary.value = summary_html(self.result)
        if self.plot:
            self.image.value = stages_png(self.result)
        return self.result

    def _repr_mimebundle_(self, **kwargs):
        """The widget, plus its controls, table and chart as static HTML (what a saved notebook shows)."""
        return snapshot_bundle(self.widget)


def memory_calculator(model: str = "gpt2", params_b: float = 7.5, dp: int = 1, stage: int = 0,
                      dtype: str = "mixed", recompute: str = "none", batch_size: int | None = None,
                      flash_attention: bool = False, gpu: str = "a100-80gb",
                      plot: bool = True) -> MemoryCalculator:
    """Build the memory calculator with these starting values (see :class:`Settings`).

    model: a preset name from :data:`course_lib.analysis.memory.PRESETS` or "custom" (then ``params_b``
    billions of parameters, model states only). dp must be a power of two up to 1024.
    """
    if dp not in DP_CHOICES:
        raise ValueError(f"dp must be one of {DP_CHOICES} in the calculator, got {dp!r}")
    if gpu not in gpu_choices():
        raise ValueError(f"gpu must be one of {', '.join(gpu_choices())}, got {gpu!r}")
    if dtype not in {value for _, value in DTYPE_CHOICES}:
        raise ValueError(f"dtype must be 'mixed', 'autocast' or 'fp32', got {dtype!r}")
    if batch_size is not None and batch_size not in range(1, BATCH_MAX + 1):  # the slider's range
        raise ValueError(f"batch_size must be a whole number from 1 to {BATCH_MAX} in the calculator, "
                         f"got {batch_size!r}")
    return MemoryCalculator(Settings(model, params_b, dp, stage, dtype, recompute, batch_size,
                                     flash_attention, gpu), plot=plot)
