"""The notebooks in a real browser: JupyterLab + headless Debian Chromium driven by Playwright.

    python -m pytest tests/test_browser.py          # make browser-deps installs chromium

One JupyterLab server (127.0.0.1, a free port, a random token, smoke mode) serves a copy of
notebooks/ and images/; for every notebook in WIDGET_CHECKS the test opens it, runs all cells
(Run All), checks that no cell failed and that every diagram and local image rendered, then
performs the notebook's widget checks: move a slider with the mouse and see the output change.
Screenshots go to test-artifacts/browser/ (also on failure).

To cover a new notebook's widget, add an entry to WIDGET_CHECKS: the notebook's file name and
one or more ``SliderCheck(label, container, output)``; the notebook is tested as soon as it exists.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from course_lib.utils import free_port, repo_root

ROOT = repo_root()
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
RUN_TIMEOUT_S = 150  # Run All of one notebook in smoke mode

pytestmark = [pytest.mark.browser, pytest.mark.slow]
if CHROMIUM is None:
    if os.geteuid() == 0:
        pytest.fail("chromium is missing: run `make browser-deps` (apt-get install chromium)", pytrace=False)
    pytestmark.append(pytest.mark.skip(reason="chromium is not installed and installing it needs root: "
                                              "sudo apt-get install chromium (or `make browser-deps` as root)"))


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


# ------------------------------------------------------------------ the server and the browser

def _settings(settings_dir: Path) -> None:
    """User settings for the test server: no autosave, no news or update checks (offline)."""
    for plugin, values in {"@jupyterlab/docmanager-extension/plugin": {"autosave": False},
                           # render every cell (no virtual scrolling): widgets stay where we found them
                           "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
                           "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                                           "checkForUpdates": False}}.items():
        path = settings_dir / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(base URL, token) of a JupyterLab serving a copy of notebooks/ and images/, and in
    reopened/ the notebooks as executed in smoke mode (outputs saved, no kernel behind them)."""
    tmp = tmp_path_factory.mktemp("lab")
    served = tmp / "course"
    shutil.copytree(ROOT / "notebooks", served / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    shutil.copytree(ROOT / "images", served / "images")
    (served / "reopened").mkdir()
    _settings(tmp / "settings")
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "COURSE_SMOKE": "1", "JUPYTER_CONFIG_DIR": str(tmp / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), "PYDEVD_DISABLE_FILE_VALIDATION": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={served}", "--LabApp.expose_app_in_browser=True",
           f"--LabApp.user_settings_dir={tmp / 'settings'}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:  # containers and CI runners
        cmd.append("--ServerApp.allow_root=True")
    log = open(tmp / "jupyterlab.log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(cmd, env=env, cwd=served, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{(tmp / 'jupyterlab.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer within 60 s:\n{(tmp / 'jupyterlab.log').read_text()[-3000:]}")
                time.sleep(0.3)
        yield base, token, served
    finally:
        _stop(proc, base, token)
        log.close()


def _stop(proc: subprocess.Popen, base: str, token: str) -> None:
    """Ask the server to shut down (it stops its kernels), then make sure its process group is gone."""
    if proc.poll() is None:
        try:
            req = urllib.request.Request(f"{base}/api/shutdown", method="POST",
                                         headers={"Authorization": f"token {token}"})
            urllib.request.urlopen(req, timeout=5).close()
            proc.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


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


def _check_slider(page, check: SliderCheck, shot: Path) -> None:
    from playwright.sync_api import expect

    scope = page.locator(check.container).first if check.container else page
    slider = scope.locator(".widget-slider", has=page.locator(".widget-label", has_text=check.label)).first
    slider.scroll_into_view_if_needed(timeout=15_000)
    box_of = slider.locator("xpath=ancestor::div[contains(concat(' ', @class, ' '), ' widget-box ')][1]")
    output = (scope if check.container else box_of).locator(check.output).first
    expect(output).not_to_have_text("", timeout=15_000)  # the widget has drawn its first output
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
    (scope if check.container else box_of).screenshot(path=str(shot))


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
    finally:
        page.screenshot(path=str(ARTIFACTS / f"{stem}.png"), full_page=False)
        try:  # stop this notebook's kernel so the next notebook has the CPU to itself
            page.evaluate("""async () => { const p = window.jupyterapp && window.jupyterapp.shell.currentWidget;
                                           if (p && p.sessionContext) await p.sessionContext.shutdown(); }""")
        except PlaywrightError:
            pass  # the page is broken; the server's shutdown stops the kernel
        page.close()


# ------------------------------------------------------------------ reopened executed notebooks

LESSONS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
RAW_REPRS = ("VBox(children=", "HBox(children=", "FloatSlider(", "IntSlider(", "interactive(children=",
             "Error displaying widget", "Loading widget...")

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


@pytest.mark.timeout(600)
def test_reopened_notebooks_show_their_saved_outputs(lab, browser, smoke_executed):
    """Open each executed notebook as a student reopening it would (outputs saved, the kernel
    that made them gone) and look at every output."""
    base, token, served = lab
    out_dir = ARTIFACTS / "reopened"
    out_dir.mkdir(parents=True, exist_ok=True)
    found, counts = {}, {}
    for name in LESSONS:
        shutil.copy(smoke_executed / name, served / "reopened" / name)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{base}/lab/tree/reopened/{name}?token={token}&reset", wait_until="domcontentloaded")
            page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output", timeout=60_000)
            page.wait_for_function("() => !document.body.innerText.includes('Loading widget...')", timeout=30_000)
            page.wait_for_timeout(1500)  # images decode
            result = page.evaluate(JS_SAVED_OUTPUTS, list(RAW_REPRS))
            counts[name] = (result["outputs"], result["images"])
            found[name] = result["problems"]
            shots = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output:has(img, .course-widget-snapshot)")
            for i in range(min(shots.count(), 8)):  # the figures and widgets, for a person to look at
                shots.nth(i).scroll_into_view_if_needed()
                shots.nth(i).screenshot(path=str(out_dir / f"{Path(name).stem}-{i}.png"))
        finally:
            page.screenshot(path=str(out_dir / f"{Path(name).stem}.png"))
            page.close()
    assert all(n > 0 for n, _ in counts.values()), f"a notebook shows no outputs: {counts}"
    bad = {name: problems for name, problems in found.items() if problems}
    assert not bad, "saved outputs that a reader cannot use:\n" + json.dumps(bad, indent=1)


@pytest.mark.timeout(300)
def test_rank_pool_output_is_grouped_by_rank(lab, browser, smoke_executed):
    """Lesson 02's %%ranks cells as a student sees them: one box per rank, headed with its rank and
    state, the rank's own output inside; the buffer tables after each ring step."""
    base, token, served = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    name = "02_collectives.ipynb"
    shutil.copy(smoke_executed / name, served / "reopened" / name)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{base}/lab/tree/reopened/{name}?token={token}&reset", wait_until="domcontentloaded")
        page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output", timeout=60_000)
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
    finally:
        page.close()
