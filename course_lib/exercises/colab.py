"""The first cells of every exercise: the Colab badge and the setup cell, which on Colab installs
the package and fetches the exercise's public tests (otter needs them as files there)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import urllib.request
from pathlib import Path

from course_lib.exercises.layout import MANIFEST, Exercise
from course_lib.utils import (GITHUB_BRANCH, GITHUB_REPO, INSTALL_SPEC_VAR, PACKAGE_DIR, colab_badge,
                              colab_install_lines, colab_url)


def exercise_setup_cell(name: str) -> str:
    """Source of an exercise's first code cell. otter needs its public tests as files next to
    the notebook; Colab opens the notebook alone, so the cell fetches them there."""
    return (
        "# Setup. On Google Colab: install the course package and fetch this exercise's public tests.\n"
        "# Anywhere else (JupyterHub, your laptop) the package and tests/ are already there.\n"
        f"# A fork or a mirror of the course: edit the spec below, or set {INSTALL_SPEC_VAR}.\n"
        + colab_install_lines(then=("from course_lib.exercises import fetch_student_tests",
                                    f'fetch_student_tests("{name}")'))
        + "\nfrom course_lib.exercises.notebook_grader import NotebookGrader  # otter.Notebook, reports escaped\n"
        f'grader = NotebookGrader("{name}.ipynb")'
    )


def fetch_student_tests(name: str, dest: str | os.PathLike = "tests", base_url: str | None = None) -> list[Path]:
    """Copy the public tests of exercise ``name`` (its ``exercises/NN_topic/tests/*.py``) into
    ``dest``, for ``grader.check`` on Colab. ``base_url`` defaults to the copy inside the installed
    package (``course_lib/_course``, the public tests as package data: offline, and from the same
    fork or mirror as the package), else the repository's raw files on GitHub; any URL urllib
    opens works (``file:///path/to/clone`` for a local copy)."""
    if base_url is None and (PACKAGE_DIR / "_course" / "exercises" / name).is_dir():
        base_url = (PACKAGE_DIR / "_course").as_uri()
    if base_url is None:
        base_url = f"https://raw.githubusercontent.com/{GITHUB_REPO}/{GITHUB_BRANCH}"
    base = f"{base_url.rstrip('/')}/exercises/{name}"
    try:
        with urllib.request.urlopen(f"{base}/{MANIFEST}", timeout=30) as r:
            manifest = json.loads(r.read().decode("utf-8"))
    except OSError as e:
        raise RuntimeError(f"could not fetch the tests of {name} from {base}: {e}") from e
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for rel in sorted(manifest["files"]):
        if rel.startswith("tests/") and rel.endswith(".py"):
            with urllib.request.urlopen(f"{base}/{rel}", timeout=30) as r:
                data = r.read()
            if hashlib.sha256(data).hexdigest() != manifest["files"][rel]:
                raise RuntimeError(f"{rel} of {name} does not match its manifest; try again later")
            target = dest / Path(rel).name
            target.write_bytes(data)
            written.append(target)
    return written


def colab_badge_line(name: str) -> str:
    """The "Open in Colab" badge that starts an exercise: it opens the student release."""
    return colab_badge(f"exercises/{name}/{name}.ipynb")


# "Follows lesson N, [NN_topic](<Colab address of notebooks/NN_topic.ipynb>)": the repository in it
LESSON_LINK = re.compile(r"https://colab\.research\.google\.com/github/[^/\s]+/[^/\s]+/blob/[^/\s]+/"
                         r"(notebooks/[^)\s]+)")


def _lesson_links(markdown: str) -> str:
    """``markdown`` with each Colab link to a lesson pointing at this course's repository."""
    return LESSON_LINK.sub(lambda m: colab_url(m.group(1)), markdown)


def _first(nb, cell_type: str):
    return next((c for c in nb.cells if c.cell_type == cell_type), None)


def setup_cell_problems(ex: Exercise) -> list[str]:
    """The first markdown cell of a source must start with the Colab badge and its first code
    cell must be :func:`exercise_setup_cell`, both for the repository in course_lib.utils.GITHUB_REPO."""
    # nbformat (0.15 s) only where a notebook is read: importing course_lib.exercises stays light
    import nbformat

    nb = nbformat.read(ex.source, as_version=4)
    problems = []
    fix = "run `course exercises sync` (it rewrites them from course_lib.utils.GITHUB_REPO)"
    md, code = _first(nb, "markdown"), _first(nb, "code")
    if md is None or md.source.split("\n", 1)[0] != colab_badge_line(ex.name):
        problems.append(f"{ex.source}: the first markdown cell does not start with the Colab badge of {ex.name}; {fix}")
    elif _lesson_links(md.source) != md.source:
        problems.append(f"{ex.source}: the first markdown cell links a lesson of another repository; {fix}")
    if code is None or code.source != exercise_setup_cell(ex.name):
        problems.append(f"{ex.source}: the first code cell is not the setup cell of {ex.name}; {fix}")
    return problems


def sync_setup_cell(ex: Exercise) -> bool:
    """Rewrite the badge line and the setup cell of ``ex``'s source; True if anything changed."""
    # nbformat (0.15 s) only where a notebook is read: importing course_lib.exercises stays light
    import nbformat

    nb = nbformat.read(ex.source, as_version=4)
    md, code = _first(nb, "markdown"), _first(nb, "code")
    if md is None or code is None:
        raise ValueError(f"{ex.source} needs a markdown cell (title) and a code cell (setup)")
    badge = colab_badge_line(ex.name)
    first, _, rest = md.source.partition("\n")
    new_md = md.source if first == badge else (
        badge + "\n" + rest if "colab.research.google.com" in first else badge + "\n\n" + md.source)
    new_md = _lesson_links(new_md)
    if new_md == md.source and code.source == exercise_setup_cell(ex.name):
        return False
    md.source, code.source = new_md, exercise_setup_cell(ex.name)
    ex.source.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    return True
