"""Shared by the browser tests: the lessons executed once in smoke mode.

Test order: the notebook executions (tests/test_notebooks.py) run before the tests that reuse
their executed copies (test_browser.py's reopened notebooks, test_book.py's website), so one
`make test` executes each notebook once.
"""

from __future__ import annotations

import pytest

LAST = ("test_browser.py", "test_book.py")


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.path.name in LAST)  # stable: the order within each group stays


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
