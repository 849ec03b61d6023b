"""A slider over the steps of a traced PRAM run (lesson 6), saved with a static copy of every step.

    from course_lib import pram
    from course_lib.notebook.pram_slider import step_slider
    step_slider(pram.run(pram.tree_sum(8), "EREW", trace=True))
"""

from __future__ import annotations

from collections.abc import Sequence

from course_lib.notebook.static import with_snapshot
from course_lib.pram.trace import all_steps_html, render_step


def step_slider(result, arrays: Sequence[str] | None = None):
    """A slider over the steps (0 = initial memory, k = after step k) above the rendering.

    Returns :func:`course_lib.notebook.static.with_snapshot` of the ipywidgets ``VBox``
    (``.widget``): a saved notebook shows every step as static HTML instead of the widget's repr.
    """
    import ipywidgets as widgets  # only here: the package must import without ipywidgets

    slider = widgets.IntSlider(value=0, min=0, max=len(result.trace or []),
                               description="step", continuous_update=True)
    view = widgets.HTML(render_step(result, -1, arrays))

    def show(change):
        view.value = render_step(result, change["new"] - 1, arrays)

    slider.observe(show, names="value")
    return with_snapshot(widgets.VBox([slider, view]), html=all_steps_html(result, arrays))
