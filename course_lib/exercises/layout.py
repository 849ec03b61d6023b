"""Where the exercises live: ``exercises/NN_topic/NN_topic.ipynb`` and its ``dist/``; shared helpers."""

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


@dataclass(frozen=True)
class Exercise:
    name: str  # NN_topic
    dir: Path  # exercises/NN_topic

    @property
    def source(self) -> Path:
        return self.dir / f"{self.name}.ipynb"

    @property
    def dist(self) -> Path:
        return self.dir / "dist"

    @property
    def student_notebook(self) -> Path:
        return self.dist / "student" / f"{self.name}.ipynb"

    @property
    def solution_notebook(self) -> Path:
        return self.dist / "autograder" / f"{self.name}.ipynb"

    @property
    def autograder_zip(self) -> Path:
        return self.dist / "autograder" / ZIP_NAME


def default_root() -> Path:
    """``exercises/`` of this clone (the exercises are not shipped inside the wheel)."""
    root = repo_root()
    if root is None or not (root / "exercises").is_dir():
        raise FileNotFoundError(
            "no exercises/ folder found: run from a clone of the course repository, or pass "
            "--root (build) / --autograder (grade)")
    return root / "exercises"


def discover(root: Path | None = None) -> list[Exercise]:
    """Every ``root/NN_topic/NN_topic.ipynb``, in order."""
    root = Path(root) if root is not None else default_root()
    found = [Exercise(d.name, d) for d in sorted(root.iterdir())
             if d.is_dir() and (d / f"{d.name}.ipynb").is_file()]
    return found


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
