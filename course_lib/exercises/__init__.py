"""Graded exercises: build student and autograder releases with otter-grader, grade locally.

    course exercises build [NAME ...]      # = make exercises
    course exercises check                 # is every student release up to date with its source?
    course grade subs/*.ipynb --jobs 2 --csv grades.csv --feedback feedback/

Layout (:mod:`.layout`): ``instructor/NN_topic/NN_topic.ipynb`` is the instructor source in
otter-grader's assign format (questions, solutions, public and hidden tests, committed without
outputs; public, like a textbook's answer key: students get the tree ``publish`` writes). ``build`` runs ``otter assign`` on it and writes

    exercises/NN_topic/NN_topic.ipynb          what students get (committed, public)
    exercises/NN_topic/tests/*.py              its public tests
    exercises/NN_topic/MANIFEST.json           source hash + hash of every file above
    build/exercises/NN_topic/                  solution notebook, all tests, autograder.zip
                                               (gitignored: only on the instructor's machine)

otter writes random cell ids and a time-stamped zip; we replace both with deterministic ones, so a
rebuild of an unchanged source reproduces the release byte for byte, and the manifest lets a test
tell a stale or hand-edited release from a fresh one. Generated files are never edited by hand.

Grading runs ``otter run``'s code path (``otter.api.grade_submission``, no Docker, no network),
each submission in a worker process that is killed at its time limit; inside, every check of an
answer runs in a killable child (:mod:`course_lib.exercises.grading`), and the
:class:`CellTimeLimit` plugin bounds every submission cell. The autograder zip also runs on
Gradescope (its environment installs CPU torch and this package's wheel).

Modules: :mod:`.layout` (where exercises live), :mod:`.colab` (badge and setup cell, public tests
on Colab), :mod:`.notebook_grader` (the ``grader`` the setup cell makes: otter's Notebook, its
reports' HTML escaped), :mod:`.build` (otter assign, manifest, staleness, Gradescope files), :mod:`.grade`
(grading and its limits), :mod:`.draws` (hidden tests' inputs, seeded per submission),
:mod:`.gradebook` (CSV, feedback files), :mod:`.publish` (the student tree, a new exercise from a
template), :mod:`.cli` (the commands), :mod:`.grading` (what the tests use), :mod:`.p2p` (point-to-point only, bytes counted), :mod:`.cell_limit` (the
CellTimeLimit plugin), :mod:`.runner` (notebooks run by nbclient, for grading and the course website,
without waiting out a lost wake-up). Importing the package imports neither otter nor torch (``notebook_grader``, imported on its own,
imports otter).
"""

from course_lib.exercises.build import (
    BUILD_FORMAT,
    build_exercise,
    check_exercise,
    otter_version,
    source_problems,
)
from course_lib.exercises.cli import cli, grade_cli
from course_lib.exercises.colab import (
    colab_badge_line,
    exercise_setup_cell,
    fetch_student_tests,
    setup_cell_problems,
    sync_setup_cell,
)
from course_lib.exercises.draws import submission_seed
from course_lib.exercises.grade import (
    CELL_TIMEOUT_ENV,
    CellTimeLimit,
    GradeReport,
    QuestionScore,
    find_autograder,
    grade,
    grade_many,
    grading_env,
    questions_in,
)
from course_lib.exercises.gradebook import write_csv, write_feedback
from course_lib.exercises.layout import (
    MANIFEST,
    RELEASES,
    SOURCES,
    ZIP_NAME,
    Exercise,
    default_root,
    discover,
    discover_releases,
    select,
)
from course_lib.exercises.publish import new_exercise, publish

__all__ = [
    "BUILD_FORMAT",
    "CELL_TIMEOUT_ENV",
    "MANIFEST",
    "RELEASES",
    "SOURCES",
    "ZIP_NAME",
    "CellTimeLimit",
    "Exercise",
    "GradeReport",
    "QuestionScore",
    "build_exercise",
    "check_exercise",
    "cli",
    "colab_badge_line",
    "default_root",
    "discover",
    "discover_releases",
    "exercise_setup_cell",
    "fetch_student_tests",
    "find_autograder",
    "grade",
    "grade_cli",
    "grade_many",
    "grading_env",
    "new_exercise",
    "otter_version",
    "publish",
    "questions_in",
    "select",
    "setup_cell_problems",
    "source_problems",
    "submission_seed",
    "sync_setup_cell",
    "write_csv",
    "write_feedback",
]
