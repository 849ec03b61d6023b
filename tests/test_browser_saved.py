"""Executed notebooks reopened in JupyterLab, as a student finds them: saved outputs, no kernel.

    python -m pytest tests/test_browser_saved.py     # make browser-deps installs chromium

The lessons as executed in smoke mode (conftest.py's ``smoke_executed``) are copied into the
session's JupyterLab (tests/browser_lab.py) and opened one at a time in one page, in which the
app has booted once: every output of every lesson is looked at (widget reprs, clipped boxes,
images that did not load, progress bars saved at 0%), and lesson 02's output of ``%%ranks``
cells is read box by box. Screenshots go to test-artifacts/browser/.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from browser_lab import RAW_REPRS, ROOT, marks

ARTIFACTS = ROOT / "test-artifacts" / "browser"

pytestmark = marks()

LESSONS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))

# What a reader of a saved notebook would find wrong, per output: widget reprs instead of widgets,
# content cut off by a box that does not scroll, images that did not load, and progress bars
# saved before they started.
JS_SAVED_OUTPUTS = r"""(raw) => {
  const outputs = Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output'));
  const problems = [];
  const where = (el) => {
    const cell = el.closest('.jp-Cell');
    const cells = Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell'));
    return 'cell ' + cells.indexOf(cell);
  };
  for (const out of outputs) {
    const text = out.innerText || '';
    for (const r of raw) if (text.includes(r)) problems.push(where(out) + ': raw widget text ' + JSON.stringify(r));
    if (/(^|\s)0%\|[^\n]*\| 0\/\d/.test(text)) problems.push(where(out) + ': a progress bar saved at 0%');
    for (const img of out.querySelectorAll('img')) {
      if (!img.complete || img.naturalWidth === 0) problems.push(where(out) + ': empty image ' + img.src.slice(0, 60));
    }
    for (const el of [out, ...out.querySelectorAll('*')]) {
      if (el.clientWidth === 0 || el.scrollWidth <= el.clientWidth + 2) continue;
      let box = el;  // the nearest box (itself or up to the output) that decides the overflow
      while (box !== out.parentElement && getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
      const mode = box === out.parentElement ? 'visible' : getComputedStyle(box).overflowX;
      if (mode === 'hidden' || mode === 'clip') {
        problems.push(where(out) + ': clipped <' + el.tagName.toLowerCase() + ' class=' + el.className + '> ' +
                      el.scrollWidth + ' px wide in ' + el.clientWidth + ' px without a scroll bar');
        break;
      }
    }
  }
  return {outputs: outputs.length, images: outputs.reduce((n, o) => n + o.querySelectorAll('img').length, 0),
          problems: problems};
}"""


@pytest.fixture(scope="module")
def lab_page(lab, browser):
    """One JupyterLab page, loaded once: the saved notebooks open in it one at a time (the app
    boots once, not once per notebook)."""
    base, token, _ = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{base}/lab?token={token}&reset", wait_until="domcontentloaded")
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=60_000)
        page.evaluate("async () => { await window.jupyterapp.restored; }")
        yield page
    finally:
        page.close()


JS_OPEN = """async (path) => {
  const app = window.jupyterapp;
  for (const w of Array.from(app.shell.widgets('main'))) w.dispose();  // alone, as a fresh page shows it
  const panel = await app.commands.execute('docmanager:open', {path: path, factory: 'Notebook'});
  await panel.context.ready;
  app.shell.activateById(panel.id);
}"""
# every image of the notebook's outputs loaded (or failed: JS_SAVED_OUTPUTS reports it), fonts ready
JS_SETTLED = """() => document.fonts.status === 'loaded' && Array.from(document.querySelectorAll(
  '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output img')).every(img => img.complete)"""


def _show_saved(page, name: str) -> None:
    """Open reopened/``name`` (saved outputs, no kernel behind them) alone in ``page``; return
    once its outputs, widgets and images are drawn."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.evaluate(JS_OPEN, f"reopened/{name}")
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output", timeout=60_000)
    page.wait_for_function("() => !document.body.innerText.includes('Loading widget...')", timeout=30_000)
    try:
        page.wait_for_function(JS_SETTLED, timeout=15_000)
    except PlaywrightTimeout:
        pass  # an image that never loads: the check below names it
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")  # laid out


@pytest.mark.timeout(600)
def test_reopened_notebooks_show_their_saved_outputs(lab, lab_page, smoke_executed):
    """Open each executed notebook as a student reopening it would (outputs saved, the kernel
    that made them gone) and look at every output."""
    _, _, served = lab
    page = lab_page
    out_dir = ARTIFACTS / "reopened"
    out_dir.mkdir(parents=True, exist_ok=True)
    found, counts = {}, {}
    for name in LESSONS:
        shutil.copy(smoke_executed / name, served / "reopened" / name)
        try:
            _show_saved(page, name)
            result = page.evaluate(JS_SAVED_OUTPUTS, list(RAW_REPRS))
            counts[name] = (result["outputs"], result["images"])
            found[name] = result["problems"]
            shots = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output:has(img, .course-widget-snapshot)")
            for i in range(min(shots.count(), 8)):  # the figures and widgets, for a person to look at
                shots.nth(i).scroll_into_view_if_needed()
                shots.nth(i).screenshot(path=str(out_dir / f"{Path(name).stem}-{i}.png"))
        finally:
            page.screenshot(path=str(out_dir / f"{Path(name).stem}.png"))
    assert all(n > 0 for n, _ in counts.values()), f"a notebook shows no outputs: {counts}"
    bad = {name: problems for name, problems in found.items() if problems}
    assert not bad, "saved outputs that a reader cannot use:\n" + json.dumps(bad, indent=1)


@pytest.mark.timeout(300)
def test_rank_pool_output_is_grouped_by_rank(lab, lab_page, smoke_executed):
    """Lesson 02's %%ranks cells as a student sees them: one box per rank, headed with its rank and
    state, the rank's own output inside; the buffer tables after each ring step."""
    _, _, served = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    name = "02_collectives.ipynb"
    shutil.copy(smoke_executed / name, served / "reopened" / name)
    page = lab_page
    _show_saved(page, name)
    boards = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .course-rank-board")
    assert boards.count() >= 3, "no %%ranks output grouped by rank"
    boxes = boards.first.locator(".course-rank")
    texts = [boxes.nth(r).inner_text().splitlines() for r in range(4)]
    assert [t[0] for t in texts] == [f"rank {r} · done" for r in range(4)], texts
    assert texts[3][1].startswith("rank 3 of 4: data = [30.0, 31.0"), texts  # each rank's own output in its box
    boards.first.scroll_into_view_if_needed()
    boards.first.screenshot(path=str(ARTIFACTS / "rank-board.png"))
    tables = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output table:has(caption)")
    captions = [tables.nth(i).locator("caption").inner_text() for i in range(tables.count())]
    assert "ring: start" in captions and any(c.startswith("all-gather step 2") for c in captions), captions
    last = tables.nth(captions.index(next(c for c in captions if c.startswith("all-gather step 2"))))
    last.scroll_into_view_if_needed()
    last.screenshot(path=str(ARTIFACTS / "ring-last-step.png"))
    marked = last.locator("td[style*='background-color']").count()
    assert marked == 8, f"the last ring step should mark the 2 values each of the 4 ranks received, found {marked}"
