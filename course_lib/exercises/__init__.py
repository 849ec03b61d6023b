"""Graded exercises: build student and autograder releases with otter-grader, grade locally.

    course exercises build [NAME ...]      # = make exercises
    course exercises check                 # is every dist/ up to date with its source?
    course grade SUBMISSION.ipynb [...]    # score per question, then TOTAL: x / y

Layout: ``exercises/NN_topic/NN_topic.ipynb`` is the instructor source in otter-grader's assign
format (questions, solutions, public and hidden tests, committed without outputs). ``build`` runs
``otter assign`` on it and writes

    exercises/NN_topic/dist/student/NN_topic.ipynb      what students get (public tests only)
    exercises/NN_topic/dist/autograder/NN_topic.ipynb   the solution notebook
    exercises/NN_topic/dist/autograder/autograder.zip   tests incl. hidden ones, for grading
    exercises/NN_topic/dist/MANIFEST.json               source hash + hash of every file above

otter writes random cell ids and a time-stamped zip; we replace both with deterministic ones, so a
rebuild of an unchanged source reproduces dist/ byte for byte, and the manifest lets a test tell
a stale or hand-edited dist/ from a fresh one. Generated files are never edited by hand.

Grading runs ``otter run``'s code path in this process (``otter.api.grade_submission``): no Docker,
no network; the notebook executes in a local Python kernel. The :class:`CellTimeLimit` plugin (set
in each exercise's ``generate: plugins``) bounds every submission cell, so an answer that hangs
costs its points instead of stalling the grader; multi-rank answers are also bounded by
:mod:`course_lib.exercises.grading`.

Modules: :mod:`.layout` (where exercises live), :mod:`.colab` (badge and setup cell, public tests
on Colab), :mod:`.build` (otter assign, manifest, staleness), :mod:`.grade` (local grading, the
cell time limit), :mod:`.cli` (the two commands). Importing the package imports neither otter
nor torch.
"""

from course_lib.exercises.build import (
    BUILD_FORMAT,
    build,
    check,
    otter_version,
    source_problems,
)
from course_lib.exercises.cli import cli, grade_cli
from course_lib.exercises.colab import (
    colab_badge_line,
    colab_setup_cell,
    fetch_student_tests,
    install_spec,
    setup_cell_problems,
    sync_setup_cell,
)
from course_lib.exercises.grade import (
    CELL_TIMEOUT_ENV,
    CellTimeLimit,
    GradeReport,
    QuestionScore,
    find_autograder,
    grade,
    grade_many,
    questions_in,
)
from course_lib.exercises.layout import (
    MANIFEST,
    ZIP_NAME,
    Exercise,
    default_root,
    discover,
    select,
)

__all__ = [
    "BUILD_FORMAT", "CELL_TIMEOUT_ENV", "MANIFEST", "ZIP_NAME", "CellTimeLimit", "Exercise",
    "GradeReport", "QuestionScore", "build", "check", "cli", "colab_badge_line", "colab_setup_cell",
    "default_root", "discover", "fetch_student_tests", "find_autograder", "grade", "grade_cli",
    "grade_many", "install_spec", "otter_version", "questions_in", "select", "setup_cell_problems",
    "source_problems", "sync_setup_cell",
]
