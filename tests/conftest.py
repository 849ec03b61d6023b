"""Shared by the tests: the one rule that skips the tests marked gpu on a machine without one; the
grading batch of test_exercises.py; the check that a refused launch started nothing; for the
browser tests, the lessons executed once in smoke mode, one JupyterLab server and one Chromium for
the session (tests/browser_lab.py).

Test order: the notebook executions (tests/test_colab_wheel.py) run before the tests that reuse
their executed copies (test_browser_saved.py's reopened notebooks, test_book.py's website), so one
`make test` executes each notebook once. test_exercises.py runs last: its grading batch
(tests/grading_batch.py) starts with the session's first test and runs beside the others, which
come first; the notebooks, busy on both cores, come after them.
"""

from __future__ import annotations

import pytest
from kernel_cells import spawned_here

NOTEBOOKS = "test_colab_wheel.py"  # the lessons, three at a time: busy on both cores
LAST = ("test_browser.py", "test_browser_saved.py", "test_book.py")
BATCHED = "test_exercises.py"  # the module whose grading batch runs beside the others


def pytest_collection_modifyitems(session, config, items):
    # Stable: the order within each group stays. The notebooks run after the other modules, which
    # mostly leave a core idle for the grading batch: beside the notebooks it would take their CPU.
    groups = ((NOTEBOOKS,), LAST, (BATCHED,))
    items.sort(key=lambda item: next((i for i, g in enumerate(groups, 1) if item.path.name in g), 0))
    # The one rule for the tests marked gpu (pyproject.toml's markers): skipped, with the reason,
    # where no CUDA device is visible; `make test-gpu` runs them on a GPU (pytest -m gpu).
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests:
        from course_lib.hardware import gpu_count  # asks NVML: no CUDA context in the test process

        if gpu_count() == 0:
            skip = pytest.mark.skip(reason="marked gpu: needs a CUDA GPU, and this machine has none")
            for item in gpu_tests:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def grading_batch(request, tmp_path_factory):
    """test_exercises.py's build and grading batch (tests/grading_batch.py), started with the
    session's first test when a selected test needs it (the build alone when no test needs the
    gradings), so that it runs beside the others; None when none does."""
    needs = {name for item in request.session.items if item.path.name == BATCHED for name in item.fixturenames}
    if not {"built_and_wheel", "graded"} & needs:
        yield None
        return
    from grading_batch import GradingBatch  # only when needed: on import it reads every exercise's source

    batch = GradingBatch(tmp_path_factory.mktemp("exercises"), grade="graded" in needs).start()
    try:
        yield batch
    finally:
        batch.stop()


@pytest.fixture
def nothing_spawned(tmp_path):
    """The run directory of a launch the test expects refused: the launch must start no process
    and create no directory."""
    before = spawned_here()
    yield tmp_path / "run"
    assert spawned_here() <= before, "a refused launch started processes"
    assert not (tmp_path / "run").exists(), "a refused launch created its run directory"


@pytest.fixture(scope="session")
def smoke_executed():
    """Folder with every lesson executed in smoke mode: test_notebooks.py's copies when they are
    up to date (same notebook, same course_lib), otherwise executed here (and kept there)."""
    from course_lib.notebook import book
    from course_lib.utils import repo_root

    root = repo_root()
    folder = root / "test-artifacts" / "executed-smoke"
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        book.execute(path, folder, smoke=True)
    return folder


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """(base URL, token, served folder) of the one JupyterLab of the browser tests."""
    from browser_lab import running_lab

    with running_lab(tmp_path_factory.mktemp("lab")) as served:
        yield served


@pytest.fixture(scope="session")
def browser():
    """The one headless Chromium of the browser tests (Playwright, Debian's build)."""
    from browser_lab import CHROMIUM, CHROMIUM_ARGS
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()
