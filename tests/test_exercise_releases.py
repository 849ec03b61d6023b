"""The public side of the exercises: what a clone of the public repository can check by itself.

    python -m pytest tests/test_exercise_releases.py -q

The student releases in exercises/ are as their build wrote them (checked from their manifests
alone, as an installed package without the sources can), carry no solution and no hidden test,
and no autograder release is committed. tests/test_exercises.py builds them from instructor/ and
checks the tree that ``course exercises publish`` writes line by line.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from course_lib import exercises

ROOT = Path(__file__).resolve().parents[1]
RELEASES = exercises.discover_releases(ROOT)
IDS = [e.name for e in RELEASES]

# otter-grader's markers of private content, as whole lines of a cell or a test file
PRIVATE_LINE = re.compile(r"^\s*(#\s*(BEGIN|END) (SOLUTION|TESTS|HIDDEN TESTS)\b.*|#\s*HIDDEN\s*|.*#\s*SOLUTION\s*)$")
HIDDEN_CASE = re.compile(r"@test_case\([^)]*hidden\s*=\s*True")


def _public_view(ex, where: Path):
    """``ex`` as a public clone sees it: the release without its source."""
    return dataclasses.replace(ex, dir=where / "absent")


def private_lines(text: str) -> list[str]:
    """The lines of ``text`` that only an instructor source or autograder release contains."""
    hits = [ln.strip() for ln in text.splitlines() if PRIVATE_LINE.match(ln)]
    return hits + [m.group(0) for m in HIDDEN_CASE.finditer(text)]


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [name for name in out.stdout.decode().split("\0") if name]


def _cells_text(path: Path) -> str:
    return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)


def test_at_least_five_releases_in_order():
    assert len(RELEASES) >= 5
    assert [e.name[:3] for e in RELEASES] == [f"{i:02d}_" for i in range(1, len(RELEASES) + 1)]


@pytest.mark.parametrize("ex", RELEASES, ids=IDS)
def test_release_is_as_its_build_wrote_it(ex, tmp_path):
    assert exercises.check_exercise(_public_view(ex, tmp_path)) == []
    files = {p.relative_to(ex.release).parts[0] for p in ex.release.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert files == {ex.student_notebook.name, "tests", exercises.MANIFEST}
    assert list(ex.student_tests.glob("*.py")), f"{ex.name}: no public tests"


def test_check_without_sources_finds_a_hand_edit(tmp_path):
    src = RELEASES[-1]
    shutil.copytree(src.release, tmp_path / exercises.RELEASES / src.name)
    (ex,) = [_public_view(e, tmp_path) for e in exercises.discover_releases(tmp_path)]
    assert exercises.check_exercise(ex) == []
    test = next(ex.student_tests.glob("*.py"))
    test.write_text(test.read_text() + "\n# a comment\n")
    assert any("edited by hand" in m for m in exercises.check_exercise(ex))
    (ex.release / "notes.txt").write_text("extra")
    assert any("not written by the build" in m for m in exercises.check_exercise(ex))


@pytest.mark.parametrize("ex", RELEASES, ids=IDS)
def test_release_has_no_solution_and_no_hidden_test(ex):
    texts = [_cells_text(ex.student_notebook)] + [p.read_text() for p in ex.student_tests.glob("*.py")]
    for text in texts:
        assert private_lines(text) == [], f"{ex.name}: private lines in the student release"
        assert "hidden=True" not in text and "BEGIN QUESTION" not in text


def test_the_marker_check_finds_what_an_instructor_source_holds():
    """The check above is only as good as its patterns: they must match otter's markers."""
    source = "\n".join([
        "# BEGIN SOLUTION", "    return 2 * (p - 1) * alpha  # SOLUTION", "# END SOLUTION",
        "# BEGIN TESTS", "# HIDDEN", "# END TESTS", "@test_case(points=None, hid" + "den=True)"])
    assert len(private_lines(source)) == 7
    assert private_lines("x = 1  # a solution comes later\nprint('# SOLUTION')") == []


def test_sources_are_tracked_and_no_autograder_release_is():
    """The sources are in the repository (a fresh clone builds and grades every exercise); the
    autograder releases (built from them) are not, and student releases carry no marker: what
    students get is `course exercises publish`'s tree (tests/test_exercises.py checks it line by
    line)."""
    names = _tracked()
    assert {n.split("/")[1] for n in names if n.startswith(f"{exercises.SOURCES}/") and n.count("/") == 2} \
        >= {ex.name for ex in RELEASES}
    assert f"{exercises.SOURCES}/grading_cases.py" in names
    assert not [n for n in names if n.endswith(exercises.ZIP_NAME) or n.startswith("build/")], \
        "an autograder release is committed: build it with `make exercises`"
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "build/" in ignored and not [i for i in ignored if exercises.SOURCES in i]
    for name in names:
        if name.split("/")[0] == exercises.RELEASES and name.endswith((".ipynb", ".py")):
            path = ROOT / name
            text = _cells_text(path) if path.suffix == ".ipynb" else path.read_text(encoding="utf-8")
            assert private_lines(text) == [], f"{name}: {private_lines(text)[:2]}"


def test_fetch_student_tests_from_a_copy_of_the_repository(tmp_path):
    """What the Colab setup cell does, against file:// instead of raw.githubusercontent.com."""
    ex = RELEASES[0]
    written = exercises.fetch_student_tests(ex.name, tmp_path / "tests", base_url=ROOT.as_uri())
    assert sorted(p.name for p in written) == sorted(p.name for p in ex.student_tests.glob("*.py"))
    for p in written:
        assert p.read_bytes() == (ex.student_tests / p.name).read_bytes()


def test_course_grade_refuses_bad_input(tmp_path, capsys):
    assert exercises.grade_cli([str(tmp_path / "missing.ipynb")]) == 2
    assert "does not exist" in capsys.readouterr().err
    plain = tmp_path / "plain.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), plain)
    assert exercises.grade_cli([str(plain)]) == 2
    assert "assignment name" in capsys.readouterr().err
    assert exercises.grade_cli([str(plain), "--cell-timeout", "0"]) == 2
    assert exercises.grade_cli([str(plain), "--time-limit", "0"]) == 2
    assert "--time-limit must be > 0" in capsys.readouterr().err


def test_an_autograder_zip_of_an_older_course_lib_is_noticed(tmp_path):
    """Gradescope installs the course wheel inside the autograder zip (local grading imports the
    installed course_lib): a zip built before a change to course_lib would grade with the old helpers."""
    import io
    import zipfile

    from course_lib.exercises.build import zip_package_differences

    package = tmp_path / "course_lib"
    (package / "exercises").mkdir(parents=True)
    (package / "utils.py").write_text("A = 1\n")
    (package / "exercises" / "grading.py").write_text("def assert_number(): ...\n")

    def autograder(files: dict) -> Path:
        wheel = io.BytesIO()
        with zipfile.ZipFile(wheel, "w") as w:
            for name, text in files.items():
                w.writestr(name, text)
        path = tmp_path / "autograder.zip"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("course_lib-0.1-py3-none-any.whl", wheel.getvalue())
            z.writestr("tests/q1.py", "")
        return path

    same = {"course_lib/utils.py": "A = 1\n", "course_lib/exercises/grading.py": "def assert_number(): ...\n"}
    assert zip_package_differences(autograder(same), package) == []
    older = {"course_lib/utils.py": "A = 0\n", "course_lib/gone.py": ""}  # edited, removed since, grading.py added
    assert zip_package_differences(autograder(older), package) == [
        "course_lib/exercises/grading.py", "course_lib/gone.py", "course_lib/utils.py"]
