"""What ``course grade`` writes besides its report: the gradebook (``--csv``) and one
student-safe feedback file per submission (``--feedback DIR``)."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from course_lib.exercises.grade import GradeReport, assignment_of_zip, points_text
from course_lib.utils import atomic_write_bytes


def write_csv(reports: list[GradeReport], path: str | os.PathLike) -> Path:
    """The gradebook: one row per student and question, then one TOTAL row per student; ``seed``
    is the one the hidden tests drew their inputs from (to grade again with ``--seed``)."""
    path, text = Path(path), io.StringIO()
    out = csv.writer(text)
    out.writerow(["student", "assignment", "question", "score", "possible", "seed"])
    assignments = {z: assignment_of_zip(Path(z)) or "" for z in {r.autograder for r in reports}}  # a zip read once
    for r in reports:
        assignment = assignments[r.autograder]
        seed = "" if r.seed is None else r.seed
        for q in r.questions:
            out.writerow([r.student, assignment, q.name, points_text(q.score), points_text(q.possible), seed])
        out.writerow([r.student, assignment, "TOTAL", points_text(r.total), points_text(r.possible), seed])
    atomic_write_bytes(path, text.getvalue().encode("utf-8"))  # a crash leaves the old gradebook whole
    return path


def write_feedback(reports: list[GradeReport], folder: str | os.PathLike) -> list[Path]:
    """One student-safe report per submission (``FOLDER/<file name>.txt``): scores, the messages
    of public tests, and only the fact that a hidden test failed (none of its source)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for r in reports:
        path = folder / f"{r.student}.txt"
        atomic_write_bytes(path, (r.format(verbose=True, student_safe=True) + "\n").encode("utf-8"))
        written.append(path)
    return written
