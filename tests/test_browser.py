"""The notebooks in a real browser: JupyterLab + headless Debian Chromium driven by Playwright.

    python -m pytest tests/test_browser.py          # make browser-deps installs chromium

In the session's one JupyterLab server and Chromium (conftest.py, tests/browser_lab.py), for
every notebook in WIDGET_CHECKS the test opens it, runs all cells (Run All), checks that no cell
failed and that every diagram and local image rendered, then performs the notebook's widget
checks: move a slider with the mouse and see the output change. Screenshots go to
test-artifacts/browser/ (also on failure). Saved outputs: tests/test_browser_saved.py.

To cover a new notebook's widget, add an entry to WIDGET_CHECKS: the notebook's file name and
one or more ``SliderCheck(label, container, output)``; the notebook is tested as soon as it exists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from browser_lab import ROOT, marks

ARTIFACTS = ROOT / "test-artifacts" / "browser"
RUN_TIMEOUT_S = 150  # Run All of one notebook in smoke mode

pytestmark = marks()


@dataclass(frozen=True)
class SliderCheck:
    """Drag the slider labelled ``label`` (inside ``container``, a CSS selector, if given) and
    expect the text of ``output`` (a selector inside the container, or inside the slider's
    enclosing widget box when there is no container) to change."""

    label: str
    container: str | None = None
    output: str = ".widget-output, .widget-html"
    drag_px: int = 40


# notebook file -> the widget checks to run after Run All. Entries for notebooks that do not
# exist yet are ignored, so a check can be written before its notebook lands.
WIDGET_CHECKS: dict[str, tuple[SliderCheck, ...]] = {
    "01_setup_and_hardware.ipynb": (SliderCheck("params (B)", ".course-hardware-explorer", ".widget-output"),),
    # notebook 4's memory calculator (course_lib.notebook.widgets, class course-memcalc): the micro-batch
    # changes the activation memory and so the summary
    "04_zero_and_fsdp.ipynb": (SliderCheck("micro-batch", ".course-memcalc", ".widget-html"),),
    # notebook 6's PRAM step slider (course_lib.notebook.pram_slider): each step redraws the memory
    "06_pram.ipynb": (SliderCheck("step", None, ".widget-html"),),
    # notebook 7's live loss plot (course_lib.notebook.live_plot, class course-live-loss): the smoothing
    # slider changes the smoothed train loss in the status line (and the curve)
    "07_nanogpt_shakespeare.ipynb": (SliderCheck("smoothing", ".course-live-loss", ".widget-html"),),
}
NOTEBOOKS = [name for name in WIDGET_CHECKS if (ROOT / "notebooks" / name).is_file()]


# ------------------------------------------------------------------ driving JupyterLab

JS_STATE = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (!panel || !panel.content || !panel.sessionContext) return null;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const code = panel.content.widgets.filter(c => c.model.type === 'code');
  const errors = code.flatMap(c => c.model.outputs.toJSON().filter(o => o.output_type === 'error')
                                     .map(o => o.ename + ': ' + o.evalue));
  return {status: kernel ? kernel.status : 'none', cells: code.length,
          done: code.filter(c => c.model.executionCount !== null).length, errors: errors};
}"""

JS_IMAGES = """() => Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) img'))
  .filter(img => img.src.startsWith('data:') || img.src.startsWith(location.origin))
  .map(img => ({alt: img.alt, src: img.src.slice(0, 80), ok: img.complete && img.naturalWidth > 0}))"""


def _run_all(page, base: str, token: str, name: str) -> dict:
    page.goto(f"{base}/lab/tree/notebooks/{name}?token={token}&reset", wait_until="domcontentloaded")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget "
                           "&& window.jupyterapp.shell.currentWidget.sessionContext", timeout=60_000)
    page.evaluate("async () => { await window.jupyterapp.shell.currentWidget.sessionContext.ready; }")
    page.wait_for_function(f"() => ({JS_STATE})().status === 'idle'", timeout=60_000)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        state = page.evaluate(JS_STATE)
        if state["errors"] or (state["done"] == state["cells"] and state["status"] == "idle"):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}: Run All did not finish within {RUN_TIMEOUT_S} s: {state}")
        time.sleep(0.5)


# The visible parts of a widget (labels, controls, text and images): none may stick out of the
# widget's own box or cover another, as a squeezed column of controls did (clipped labels, a
# dropdown under the table beside it), and each label sits on its control's row
JS_LAYOUT = """(root) => {
  const box = root.getBoundingClientRect();
  const parts = Array.from(root.querySelectorAll(
      '.widget-label, .widget-toggle-button, .widget-dropdown select, .widget-text input, ' +
      '.widget-slider .noUi-target, .widget-readout, .widget-checkbox input, .widget-html-content, ' +
      '.widget-image, .jupyter-widgets-output-area'))
    .map(e => ({e, r: e.getBoundingClientRect()}))
    .filter(p => p.r.width > 0 && p.r.height > 0);
  const name = p => (p.e.className || p.e.tagName).toString().split(' ')[0] + ' "' +
                    (p.e.innerText || p.e.value || '').trim().slice(0, 30) + '"';
  const out = parts.filter(p => p.r.left < box.left - 1 || p.r.right > box.right + 1).map(name);
  const over = [];
  for (let i = 0; i < parts.length; i++)
    for (let j = i + 1; j < parts.length; j++) {
      const a = parts[i], b = parts[j];
      if (a.e.contains(b.e) || b.e.contains(a.e)) continue;
      const w = Math.min(a.r.right, b.r.right) - Math.max(a.r.left, b.r.left);
      const h = Math.min(a.r.bottom, b.r.bottom) - Math.max(a.r.top, b.r.top);
      if (w > 1 && h > 1) over.push(name(a) + ' and ' + name(b));
    }
  // a control's description sits beside it, on its row (not stacked above, as a ToggleButtons' was)
  const stacked = parts.filter(p => p.e.tagName === 'LABEL' && p.e.parentElement &&  // a description, not a Label
      Array.from(p.e.parentElement.children).some(c => c !== p.e && c.getBoundingClientRect().height > 0) &&
      !Array.from(p.e.parentElement.children).some(c => {
        const r = c.getBoundingClientRect();
        return c !== p.e && r.height > 0 && r.top < p.r.bottom && r.bottom > p.r.top; })).map(name);
  return {outside: out, overlapping: over, stacked: stacked};
}"""


def _check_slider(page, check: SliderCheck, shot: Path) -> None:
    from playwright.sync_api import expect

    scope = page.locator(check.container).first if check.container else page
    slider = scope.locator(".widget-slider", has=page.locator(".widget-label", has_text=check.label)).first
    slider.scroll_into_view_if_needed(timeout=15_000)
    box_of = slider.locator("xpath=ancestor::div[contains(concat(' ', @class, ' '), ' widget-box ')][1]")
    widget = scope if check.container else box_of
    output = widget.locator(check.output).first
    expect(output).not_to_have_text("", timeout=15_000)  # the widget has drawn its first output
    layout = widget.evaluate(JS_LAYOUT)
    assert layout == {"outside": [], "overlapping": [], "stacked": []}, f"{check.label}: a bad layout: {layout}"
    before, readout = output.inner_text(), slider.locator(".widget-readout").inner_text()
    handle = slider.locator(".noUi-handle").first
    handle.hover()  # scrolls it into view and puts the mouse on it
    box = handle.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + check.drag_px, y, steps=8)
    page.mouse.up()
    expect(slider.locator(".widget-readout")).not_to_have_text(readout, timeout=10_000)
    expect(output).not_to_have_text(before, timeout=30_000)
    widget.screenshot(path=str(shot))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_widgets_respond(name, lab, browser):
    from playwright.sync_api import Error as PlaywrightError

    base, token, _ = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    stem = Path(name).stem
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        state = _run_all(page, base, token, name)
        assert not state["errors"], f"{name}: a cell failed in the browser: {state['errors']}"
        images = page.evaluate(JS_IMAGES)
        broken = [i for i in images if not i["ok"]]
        assert not broken, f"{name}: images that did not render: {broken}"
        if "diagrams.show(" in (ROOT / "notebooks" / name).read_text():
            assert any(i["alt"].startswith("diagram: ") for i in images), f"{name}: no diagram rendered"
        for i, check in enumerate(WIDGET_CHECKS[name]):
            _check_slider(page, check, ARTIFACTS / f"{stem}-widget{i}.png")
        widgets = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output > .jupyter-widgets")
        assert widgets.count() >= len(WIDGET_CHECKS[name]), f"{name}: its widgets did not render"
        for i in range(widgets.count()):  # every widget of the notebook, as laid out after Run All
            widgets.nth(i).scroll_into_view_if_needed()
            layout = widgets.nth(i).evaluate(JS_LAYOUT)
            if layout != {"outside": [], "overlapping": [], "stacked": []}:
                widgets.nth(i).screenshot(path=str(ARTIFACTS / f"{stem}-layout{i}.png"))
                raise AssertionError(f"{name}: widget {i} (test-artifacts/browser/{stem}-layout{i}.png): {layout}")
    finally:
        page.screenshot(path=str(ARTIFACTS / f"{stem}.png"), full_page=False)
        try:  # stop this notebook's kernel so the next notebook has the CPU to itself
            page.evaluate("""async () => { const p = window.jupyterapp && window.jupyterapp.shell.currentWidget;
                                           if (p && p.sessionContext) await p.sessionContext.shutdown(); }""")
        except PlaywrightError:
            pass  # the page is broken; the server's shutdown stops the kernel
        page.close()
