"""Where the exercises live. Three places, so that solutions and hidden tests stay out of what
students can see:

    instructor/NN_topic/NN_topic.ipynb          source: questions, solutions, public and hidden tests
    exercises/NN_topic/NN_topic.ipynb           student release (committed, public): the notebook,
    exercises/NN_topic/tests/*.py                 its public tests and a MANIFEST.json of hashes
    build/exercises/NN_topic/                   autograder release (gitignored, made by
                                                  `make exercises`): solution notebook, all tests,
                                                  autograder.zip for `course grade` and Gradescope

``instructor/`` is tracked: the solutions are public, like a textbook's answer key. Students get
the tree that ``course exercises publish OUT`` writes (no solution, no hidden test); an instructor
who wants private exercises keeps their own sources elsewhere and passes ``--root``
(exercises/README.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from course_lib.utils import repo_root

MANIFEST = "MANIFEST.json"
ZIP_NAME = "autograder.zip"
SOURCES = "instructor"  # the private folder of instructor sources, at the top of the repository
RELEASES = "exercises"  # the public student releases
AUTOGRADERS = Path("build") / "exercises"  # local autograder releases (gitignored)


@dataclass(frozen=True)
class Exercise:
    name: str  # NN_topic
    dir: Path  # instructor/NN_topic: the source's folder
    release: Path  # exercises/NN_topic: the student release
    build: Path  # build/exercises/NN_topic: the autograder release

    @property
    def source(self) -> Path:
        return self.dir / f"{self.name}.ipynb"

    @property
    def student_notebook(self) -> Path:
        return self.release / f"{self.name}.ipynb"

    @property
    def student_tests(self) -> Path:
        return self.release / "tests"

    @property
    def solution_notebook(self) -> Path:
        return self.build / f"{self.name}.ipynb"

    @property
    def autograder_zip(self) -> Path:
        return self.build / ZIP_NAME


def default_root() -> Path:
    """``instructor/`` of this clone: the sources (not shipped inside the wheel)."""
    root = repo_root()
    if root is None or not (root / SOURCES).is_dir():
        raise FileNotFoundError(
            f"no {SOURCES}/ folder with the exercise sources found (an installed package has none): "
            "run from a clone of the course, pass --root (your own sources), or for grading "
            "--autograder ZIP")
    return root / SOURCES


def discover(root: Path | None = None) -> list[Exercise]:
    """Every ``root/NN_topic/NN_topic.ipynb``, in order; releases go next to ``root``
    (``root/../exercises``, ``root/../build/exercises``)."""
    root = Path(root) if root is not None else default_root()
    top = root.resolve().parent
    return [Exercise(d.name, d, top / RELEASES / d.name, top / AUTOGRADERS / d.name)
            for d in sorted(root.iterdir()) if d.is_dir() and (d / f"{d.name}.ipynb").is_file()]


def discover_releases(top: Path | None = None) -> list[Exercise]:
    """Every public student release ``top/exercises/NN_topic/`` (``top``: this clone), whether or
    not the private sources are here; each one's ``dir`` is where its source would be."""
    top = Path(top) if top is not None else repo_root()
    if top is None or not (top / RELEASES).is_dir():
        return []
    return [Exercise(d.name, top / SOURCES / d.name, d, top / AUTOGRADERS / d.name)
            for d in sorted((top / RELEASES).iterdir()) if (d / MANIFEST).is_file()]


def select(names: list[str], root: Path | None = None) -> list[Exercise]:
    exercises = discover(root)
    if not names:
        return exercises
    by_name = {e.name: e for e in exercises}
    by_number = {e.name.split("_", 1)[0]: e for e in exercises}
    chosen = []
    for n in names:
        ex = by_name.get(n) or by_number.get(n) or by_number.get(n.zfill(2))
        if ex is None:
            raise ValueError(f"unknown exercise {n!r}; choose from {', '.join(by_name) or '(none)'}")
        chosen.append(ex)
    return chosen


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@contextlib.contextmanager
def quiet(enabled: bool = True):
    """Silence otter and the kernels it starts (they print to the process's own stdout/stderr
    file descriptors), replaying what they said only if something goes wrong."""
    if not enabled:
        yield
        return
    otter_logger = logging.getLogger("otter")
    level = otter_logger.level
    otter_logger.setLevel(logging.ERROR)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            with contextlib.redirect_stdout(io.StringIO()) as out, \
                    contextlib.redirect_stderr(io.StringIO()) as err:
                yield
        except BaseException:
            sys.stdout.flush()
            sink.seek(0)
            said = sink.read().decode(errors="replace") + out.getvalue() + err.getvalue()
            os.dup2(saved[1], 2)
            sys.stderr.write(said)
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            otter_logger.setLevel(level)
