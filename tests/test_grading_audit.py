"""``course grade`` refuses, before grading anything, input that would cost a class its grades:
a cell limit that the kernel's alarm cannot hold, a submission that is not a readable notebook,
two submissions whose feedback files and gradebook rows would carry the same student name.

    python -m pytest tests/test_grading_audit.py -q
"""

from __future__ import annotations

import importlib
import json
import os

import pytest

from course_lib.exercises.cell_limit import CELL_TIMEOUT_ENV

# the module: `from course_lib.exercises import cli` is its function of that name (the package re-exports it)
cli = importlib.import_module("course_lib.exercises.cli")
exercises_cli = cli.cli  # `course exercises ...`


@pytest.fixture
def graded(monkeypatch):
    """The submissions ``course grade`` went on to grade (none are graded: a batch takes minutes)."""
    calls = []
    monkeypatch.setattr(cli, "grade_many", lambda subs, *a, **k: calls.append([str(s) for s in subs]) or [])
    monkeypatch.setenv(CELL_TIMEOUT_ENV, "")  # recorded, so the test's own setenv is undone after it
    monkeypatch.delenv(CELL_TIMEOUT_ENV)
    return calls


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seconds", ["nan", "inf", "3e9"])
def test_a_cell_timeout_the_alarm_cannot_hold_is_refused(tmp_path, capsys, graded, seconds):
    """Each cell's limit is ``signal.alarm(int(s))``: nan and inf made every submission of the
    class score zero (the plugin raised converting them), and past 2**31 - 1 s the alarm raised in
    each cell's hook, so that no cell was bounded at all."""
    sub, zip_ = tmp_path / "ada.ipynb", tmp_path / "ag.zip"
    sub.write_text("{}")
    zip_.write_text("")
    assert cli.grade_cli([str(sub), "--autograder", str(zip_), "--cell-timeout", seconds]) == 2
    err = capsys.readouterr().err
    assert "--cell-timeout" in err and err.count("\n") == 1, err
    assert graded == []
    assert cli.grade_cli([str(sub), "--autograder", str(zip_), "--cell-timeout", "0.5"]) == 0  # still fine
    assert len(graded) == 1
    assert CELL_TIMEOUT_ENV not in os.environ  # the grading's only: it once leaked into the next call (1 s cells)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text", [
    b'{"cells": [ truncated',  # not JSON
    b"{}",  # JSON, but no cells and no nbformat: nbformat's ValidationError, not a ValueError
    json.dumps({"metadata": {"otter": "03_zero"}, "cells": [], "nbformat": 4, "nbformat_minor": 5}).encode(),
    b"\xff\xfe\x00",  # not UTF-8
], ids=["not-json", "no-cells", "otter-not-a-dict", "not-utf8"])
def test_a_submission_that_is_no_notebook_is_named_before_grading(tmp_path, capsys, graded, text):
    """Without --autograder the assignment is read from each notebook first: a broken one crashed
    the whole class's grading with a traceback, or stopped it with a message that named no file."""
    sub = tmp_path / "Jane Doe - ex3 (final).ipynb"
    sub.write_bytes(text)
    assert cli.grade_cli([str(sub)]) == 2
    err = capsys.readouterr().err
    assert str(sub) in err and err.startswith("course grade: ") and "Traceback" not in err, err
    assert graded == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("flag", ["--feedback", "--csv"])
def test_two_submissions_with_one_student_name_are_refused_where_it_is_written(tmp_path, capsys, graded, flag):
    """The student is the file's name without .ipynb (exercises/README.md): two submissions
    ``alice/03_zero.ipynb`` and ``bob/03_zero.ipynb`` wrote one feedback file, the last graded
    overwriting the other, and gradebook rows that no one could tell apart."""
    subs = []
    for who in ["alice", "bob"]:
        (tmp_path / who).mkdir()
        subs.append(tmp_path / who / "03_zero.ipynb")
        subs[-1].write_text("{}")
    zip_, out = tmp_path / "ag.zip", tmp_path / "out"
    zip_.write_text("")
    target = str(out / "grades.csv") if flag == "--csv" else str(out)
    assert cli.grade_cli([*map(str, subs), "--autograder", str(zip_), flag, target]) == 2
    err = capsys.readouterr().err
    assert "03_zero" in err and str(subs[0]) in err and str(subs[1]) in err and err.count("\n") == 1, err
    assert graded == []
    # the reports on stdout name each file by its path: without a gradebook or feedback, both are graded
    assert cli.grade_cli([*map(str, subs), "--autograder", str(zip_)]) == 0
    assert graded == [[str(s) for s in subs]]


@pytest.mark.timeout(30)
def test_a_cell_timeout_set_in_the_environment_is_checked_like_the_flag(tmp_path, capsys, graded, monkeypatch):
    """COURSE_GRADING_CELL_TIMEOUT set by hand bypassed the flag's check: nan reached every cell's
    alarm (every submission scored zero). The plugin reads it through the same check."""
    from course_lib.exercises.cell_limit import CellTimeLimit

    sub, zip_ = tmp_path / "ada.ipynb", tmp_path / "ag.zip"
    sub.write_text("{}")
    zip_.write_text("")
    for value in ("nan", "-3", "soon"):
        monkeypatch.setenv(CELL_TIMEOUT_ENV, value)
        assert cli.grade_cli([str(sub), "--autograder", str(zip_)]) == 2
        err = capsys.readouterr().err
        assert f"{CELL_TIMEOUT_ENV} must be a number of seconds > 0" in err and err.count("\n") == 1, err
        with pytest.raises(ValueError, match=CELL_TIMEOUT_ENV):
            CellTimeLimit(sub, {}, {}).seconds()
    assert graded == []
    monkeypatch.setenv(CELL_TIMEOUT_ENV, "30")
    assert cli.grade_cli([str(sub), "--autograder", str(zip_)]) == 0 and len(graded) == 1
    assert CellTimeLimit(sub, {}, {}).seconds() == 30
    monkeypatch.delenv(CELL_TIMEOUT_ENV)
    assert CellTimeLimit(sub, {}, {"cell_timeout": 45}).seconds() == 45
    with pytest.raises(ValueError, match="cell_timeout must be"):
        CellTimeLimit(sub, {}, {"cell_timeout": float("inf")}).seconds()


def test_a_folder_given_as_a_submission_or_as_publish_s_target_is_named(tmp_path, capsys):
    """`course grade FOLDER` said the folder "does not exist"; `course exercises publish FILE` ended
    in a NotADirectoryError traceback."""
    assert cli.grade_cli([str(tmp_path)]) == 2
    assert f"{tmp_path} is a folder: give its notebooks" in capsys.readouterr().err
    target = tmp_path / "a_file"
    target.write_text("")
    assert exercises_cli(["publish", str(target)]) == 1
    assert f"{target} is a file; publish into a new folder" in capsys.readouterr().err
