"""The graded exercises, built from their sources: releases are fresh, grading scores right and never hangs.

    python -m pytest tests/test_exercises.py -q

Sources live in instructor/ (solutions, hidden tests; tracked and public, like a textbook's answer
key); student releases in exercises/ (committed); autograder releases are built here into a
temporary folder, as `make exercises` builds them into build/ for an instructor, and the student
tree that ``course exercises publish`` writes is checked line by line for solutions and hidden
tests. Grading goes through otter-grader's own code path (``otter run`` without Docker), each
submission in a worker process with its own seed for the hidden tests' drawn inputs: every
solution must score full marks, every blank student release zero; for every question a
submission with one typical mistake in it must lose that question (with a message that names the
mistake) and keep every other; for every exercise a submission that hard-codes the public answers
(or the values the solutions print) earns at most a quarter; a deadlocked, an endless and a
tampering answer each cost only their question, within the limits. The gradings run with an audit hook (a
``sitecustomize`` on PYTHONPATH, inherited by otter, the kernels it starts and the ranks they
fork) that refuses and records any connection to a non-loopback host and any attempt to start
Docker. The Gradescope zip is unpacked into a fresh virtual environment (this environment's
packages through a .pth file, plus the zip's own course_lib wheel) and run with otter's runner.

The building and the gradings are one batch (tests/grading_batch.py) that starts with the
session's first test and runs beside the others at a lower priority; this module runs last
(tests/conftest.py) and checks what the batch left.
"""

from __future__ import annotations

import ast
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest
from grading_batch import (
    BY_NAME,
    CLI_GRADED,
    CLI_NAME,
    EXERCISES,
    GRADESCOPE,
    GRADING_TIMEOUT,
    HARD_CODED,
    HUNG,
    MISTAKES,
    SKIPPED_LIMIT,
    STOPPED_LIMIT,
    STOPPED_MARK,
    STUDENT_RUN,
    TAMPERED,
    ZERO,
    patched,
)
from kernel_cells import left_behind

from course_lib import exercises
from course_lib.utils import colab_url

ROOT = Path(__file__).resolve().parents[1]
IDS = [e.name for e in EXERCISES]

# --------------------------------------------------------------------------------------------
# The releases
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built_and_wheel(grading_batch):
    """Every exercise built from a copy of its source, as `make exercises` does: releases in
    tmp/exercises, autograder releases in tmp/build/exercises (one course_lib wheel for all); by the
    grading batch (tests/grading_batch.py), which started it with the session."""
    return grading_batch.built()


@pytest.fixture(scope="module")
def built(built_and_wheel):
    return built_and_wheel[0]


@pytest.fixture(scope="module")
def published(built, tmp_path_factory):
    """The student tree, as `course exercises publish` writes it from the built releases."""
    out = tmp_path_factory.mktemp("published") / "course"
    exercises.publish(list(built.values()), out, ROOT / "data")
    return out


def test_every_source_has_its_release_and_every_release_its_source():
    assert len(EXERCISES) >= 5
    assert [e.name for e in EXERCISES] == [e.name for e in exercises.discover_releases(ROOT)]


@pytest.mark.parametrize("ex", EXERCISES, ids=IDS)
def test_source_is_clean_and_release_is_fresh(ex):
    assert exercises.source_problems(ex) == []  # committed without outputs
    assert exercises.setup_cell_problems(ex) == []  # installs on Colab only, current repository
    assert exercises.check_exercise(ex) == []  # the release was built from this source and not edited since


# otter writes the tests with ast.unparse, whose text is the same on Python 3.11 and 3.13 (both run
# here, 2026-11-28); 3.10's differs in form only, e.g. `for (i, x) in ...` and `lambda :`.
SAME_UNPARSE = sys.version_info >= (3, 11)


@pytest.mark.timeout(300)
def test_rebuild_reproduces_committed_release(built):
    """otter assign on copies of the sources gives the student releases byte for byte: the
    manifest is honest and a rebuild after an edit shows as a clean diff. (On Python 3.10 the
    tests' code, by its syntax tree, and the manifest's other entries.)"""
    for name, copy in built.items():
        original = BY_NAME[name]
        rebuilt = sorted(p.relative_to(copy.release) for p in copy.release.rglob("*") if p.is_file())
        committed = sorted(p.relative_to(original.release) for p in original.release.rglob("*")
                           if p.is_file() and "__pycache__" not in p.parts)
        assert rebuilt == committed, f"{name}: rebuilt files differ from the committed ones"
        for rel in rebuilt:
            new, old = (copy.release / rel).read_bytes(), (original.release / rel).read_bytes()
            if not SAME_UNPARSE and rel.suffix == ".py":
                new, old = (ast.dump(ast.parse(text)).encode() for text in (new, old))
            elif not SAME_UNPARSE and rel.name == exercises.MANIFEST:
                new, old = (json.loads(text) for text in (new, old))
                for manifest in (new, old):  # the tests' hashes: of the text, compared above by tree
                    manifest["files"] = {f: h for f, h in manifest["files"].items() if not f.endswith(".py")}
            assert new == old, f"{name}: exercises/{name}/{rel} is stale; run `make exercises`"


def test_check_reports_stale_and_hand_edited_release(tmp_path):
    src = EXERCISES[-1]
    shutil.copytree(src.dir, tmp_path / exercises.SOURCES / src.name)
    shutil.copytree(src.release, tmp_path / exercises.RELEASES / src.name)
    ex = exercises.discover(tmp_path / exercises.SOURCES)[0]
    assert exercises.check_exercise(ex) == []

    student = ex.student_notebook
    student.write_text(student.read_text().replace("grader.check", "grader.check "), encoding="utf-8")
    assert any("edited by hand" in m for m in exercises.check_exercise(ex))
    shutil.copy2(src.student_notebook, student)

    (ex.release / "notes.txt").write_text("extra")
    assert any("not written by the build" in m for m in exercises.check_exercise(ex))
    (ex.release / "notes.txt").unlink()

    nb = nbformat.read(ex.source, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("One more paragraph."))
    nbformat.write(nb, ex.source)
    assert any("changed since its release was built" in m for m in exercises.check_exercise(ex))

    (ex.release / exercises.MANIFEST).unlink()
    assert any("run `course exercises build" in m for m in exercises.check_exercise(ex))


def test_sync_rewrites_badge_and_setup_cell(tmp_path):
    src = EXERCISES[1]
    (tmp_path / src.name).mkdir()
    shutil.copy2(src.source, tmp_path / src.name / src.source.name)
    ex = exercises.discover(tmp_path)[0]
    nb = nbformat.read(ex.source, as_version=4)
    md = next(c for c in nb.cells if c.cell_type == "markdown")
    code = next(c for c in nb.cells if c.cell_type == "code")
    from course_lib.utils import GITHUB_REPO

    md.source = md.source.replace(GITHUB_REPO, "someone/old-name")
    code.source = code.source.replace(GITHUB_REPO, "someone/old-name")
    nbformat.write(nb, ex.source)
    assert len(exercises.setup_cell_problems(ex)) == 2
    assert exercises.sync_setup_cell(ex) is True
    assert exercises.setup_cell_problems(ex) == []
    assert ex.source.read_bytes() == src.source.read_bytes()  # back to the committed source
    assert exercises.sync_setup_cell(ex) is False
    with pytest.raises(ValueError, match="unknown exercise"):
        exercises.select(["99"], tmp_path)


def test_build_refuses_a_source_with_outputs(tmp_path):
    src = EXERCISES[0]
    (tmp_path / src.name).mkdir()
    nb = nbformat.read(src.source, as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code" and "import" in c.source)
    code.outputs = [nbformat.v4.new_output("stream", text="hello\n")]
    nbformat.write(nb, tmp_path / src.name / src.source.name)
    ex = exercises.discover(tmp_path)[0]
    with pytest.raises(ValueError, match="has outputs"):
        exercises.build_exercise(ex)
    assert not ex.release.exists() and not ex.build.exists()


def test_build_refuses_a_test_that_python_3_12_would_write_back_unreadable_for_3_11(tmp_path):
    """otter writes tests back with ast.unparse; from Python 3.12 it reuses an f-string's quotes for
    a string inside its braces (f'{r['A']}'), a SyntaxError on 3.10/3.11. Such a test is refused,
    with its cell and line, on any Python: a release built on 3.12+ must load on a student's 3.11."""
    src = EXERCISES[0]
    (tmp_path / src.name).mkdir()
    nb = nbformat.read(src.source, as_version=4)
    begin = next(i for i, c in enumerate(nb.cells) if c.cell_type == "raw" and c.source.strip() == "# BEGIN TESTS")
    test = nb.cells[begin + 1]
    test.source += ('\n\ndef test_extra(r):\n    x = 1.5\n    assert x, f"{x:.3f} {x!r:>8} {len(r)}"\n'
                    '    assert r, f"found {r[\'A\']}"\n')
    nbformat.write(nb, tmp_path / src.name / src.source.name)
    ex = exercises.discover(tmp_path)[0]
    problems = exercises.source_problems(ex)
    line = test.source.splitlines().index("    assert r, f\"found {r['A']}\"") + 1
    assert problems == [f"{ex.source}: cell {begin + 1}, line {line}: a string inside an f-string's braces, "
                        "{r['A']}: otter writes the test back with ast.unparse, which on Python 3.12+ puts "
                        "the f-string's own quotes there, and Python 3.10 and 3.11 cannot read that; bind the "
                        "value to a name before the f-string"], problems  # format specs and !r are fine
    with pytest.raises(ValueError, match="a string inside an f-string's braces"):
        exercises.build_exercise(ex)
    assert not ex.release.exists() and not ex.build.exists()


def _solution_lines(source: Path) -> set[str]:
    """Distinctive lines of the instructor solutions: inside '# BEGIN/END SOLUTION' markers or
    ending in '# SOLUTION', that appear nowhere else in the source."""
    nb = nbformat.read(source, as_version=4)
    solution, elsewhere = set(), set()
    in_block = False  # inside a '# BEGIN SOLUTION' ... '# END SOLUTION' raw-cell block
    for cell in nb.cells:
        text = cell.source.strip()
        if cell.cell_type == "raw":
            if re.match(r"#\s*BEGIN SOLUTION", text):
                in_block = True
            elif re.match(r"#\s*END SOLUTION", text):
                in_block = False
            continue
        if cell.cell_type != "code":
            continue
        inside = False
        for line in cell.source.splitlines():
            s = line.strip()
            if re.match(r"#\s*BEGIN SOLUTION", s):
                inside = True
            elif re.match(r"#\s*END SOLUTION", s):
                inside = False
            elif in_block and (inside or s.endswith("# SOLUTION")):
                solution.add(s.removesuffix("# SOLUTION").strip())
            else:
                elsewhere.add(s)
    return {s for s in solution - elsewhere if len(s) >= 12}


def _test_cases(zip_path: Path) -> list[tuple[str, bool, list[str]]]:
    """(function name, hidden?, stripped source lines) of every test case in an autograder zip."""
    import ast

    cases = []
    with zipfile.ZipFile(zip_path) as zf:
        for name in zf.namelist():
            if not (name.startswith("tests/") and name.endswith(".py")):
                continue
            for node in ast.parse(zf.read(name).decode()).body:
                if isinstance(node, ast.FunctionDef):
                    deco = ast.unparse(node.decorator_list[0]) if node.decorator_list else ""
                    body = [ln.strip() for ln in ast.unparse(node.body).splitlines()]
                    cases.append((node.name, "hidden=True" in deco, body))
    return cases


def _lines_outside_tests(source: Path) -> set[str]:
    """Stripped lines of the source's code cells that are not in a BEGIN/END TESTS block."""
    nb = nbformat.read(source, as_version=4)
    lines, in_tests = set(), False
    for cell in nb.cells:
        if cell.cell_type == "raw":
            in_tests = {"# BEGIN TESTS": True, "# END TESTS": False}.get(cell.source.strip(), in_tests)
        elif cell.cell_type == "code" and not in_tests:
            lines |= {ln.strip() for ln in cell.source.splitlines()}
    return lines


def _hidden_test_cases(ex) -> list[tuple[str, list[str]]]:
    """Hidden test cases with the lines only they contain (in no public test, no prompt cell)."""
    cases = _test_cases(ex.autograder_zip)
    shared = {ln for _, hidden, body in cases if not hidden for ln in body} | _lines_outside_tests(ex.source)
    return [(f, [ln for ln in body if ln not in shared]) for f, hidden, body in cases if hidden]


@pytest.mark.parametrize("ex", EXERCISES, ids=IDS)
def test_student_release_has_no_solutions_and_no_hidden_tests(ex, built):
    student_files = [p for p in ex.release.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert {p.relative_to(ex.release).parts[0] for p in student_files} == {ex.source.name, "tests", exercises.MANIFEST}
    text = "\n".join(p.read_text(encoding="utf-8") for p in student_files)
    nb = nbformat.read(ex.student_notebook, as_version=4)
    sources = [c.source for c in nb.cells] + [p.read_text() for p in student_files if p.suffix == ".py"]
    lines = {ln.strip() for src in sources for ln in src.splitlines()}

    for marker in ("BEGIN SOLUTION", "END SOLUTION", "# SOLUTION", "BEGIN TESTS", "# HIDDEN",
                   "hidden=True", "BEGIN QUESTION"):
        assert marker not in text, f"{ex.name}: student release contains {marker!r}"

    solutions = _solution_lines(ex.source)
    assert solutions, f"{ex.name}: no solution lines found in the source (test helper broken?)"
    leaked = sorted(solutions & lines)
    assert not leaked, f"{ex.name}: solution lines in the student release: {leaked[:3]}"

    hidden = _hidden_test_cases(built[ex.name])
    assert hidden, f"{ex.name}: the autograder has no hidden tests"
    for func, own_lines in hidden:
        assert func not in text, f"{ex.name}: hidden test {func} is in the student release"
        shown = [ln for ln in own_lines if len(ln) >= 30 and ln in lines]
        assert not shown, f"{ex.name}: lines of hidden test {func} are in the student release: {shown[:2]}"

    # every question has its public tests next to the student notebook
    questions = exercises.questions_in(built[ex.name].autograder_zip)
    assert {p.stem for p in ex.student_tests.glob("*.py")} == set(questions)


def _private_content(files: list[Path], built) -> list[str]:
    """What of the solutions and hidden tests ``files`` hold: otter's markers, solution lines,
    hidden test functions and the lines only a hidden test has (each as 'file: what')."""
    from test_exercise_releases import private_lines

    solutions = {ex.name: _solution_lines(ex.source) for ex in EXERCISES}
    # lines any exercise shows students (a hidden test may share an idiom with another exercise)
    shown_anywhere = set().union(*(_lines_outside_tests(ex.source) for ex in EXERCISES)) | {
        ln for ex in built.values() for _, is_hidden, body in _test_cases(ex.autograder_zip) if not is_hidden for ln in body}
    hidden = {ex.name: [(f, [ln for ln in own if len(ln) >= 40 and ln not in shown_anywhere
                             and not ln.startswith(("import ", "from "))])
                        for f, own in _hidden_test_cases(built[ex.name])] for ex in EXERCISES}
    found = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".ipynb":  # the cells' lines, not the JSON's
            text = "\n".join(c.source for c in nbformat.reads(text, as_version=4).cells)
        lines = {ln.strip() for ln in text.splitlines()}
        found += [f"{path.name}: marker {m!r}" for m in private_lines(text)]
        for name, solution in solutions.items():
            found += [f"{path.name}: solution line of {name}: {ln!r}" for ln in sorted(solution & lines)]
            for func, own in hidden[name]:
                found += [f"{path.name}: hidden test {func} of {name}"] if f"def {func}(" in text else []
                found += [f"{path.name}: line of hidden test {func}: {ln!r}" for ln in own if ln in lines]
    return found


def test_published_tree_holds_no_solution_line_and_no_hidden_test(published, built):
    """What students get (`course exercises publish`): the student notebooks, their public tests,
    manifests, data and a README, and not one solution line, marker or hidden test line."""
    files = sorted(p for p in published.rglob("*") if p.is_file())
    tops = {p.relative_to(published).parts[0] for p in files}
    assert tops == {"exercises", "data", "README.md"}, tops
    assert {p.parent.name for p in files if p.suffix == ".ipynb"} == set(IDS)
    for ex in built.values():
        assert sorted(p.name for p in (published / "exercises" / ex.name / "tests").glob("*.py")) == \
            sorted(p.name for p in ex.student_tests.glob("*.py"))
    assert not [p for p in files if p.suffix == ".zip" or "instructor" in p.parts or "grading_cases" in p.name]
    shipped = subprocess.run(["git", "ls-files", "data"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert sorted(p.name for p in (published / "data").iterdir()) == sorted(Path(n).name for n in shipped.stdout.split())
    text_files = [p for p in files if p.suffix in (".ipynb", ".py", ".md", ".json")]
    assert _private_content(text_files, built) == []
    # the check sees what it is meant to: the sources themselves are full of it
    assert _private_content([ex.source for ex in EXERCISES], built)


def test_wheel_carries_no_solution_and_no_hidden_test(built_and_wheel, tmp_path):
    built, wheel = built_and_wheel
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(tmp_path)
    assert not [n for n in names if "instructor" in n.split("/") or n.endswith((".ipynb", ".zip"))], names
    course = [p for p in (tmp_path / "course_lib" / "_course").rglob("*") if p.is_file()]
    assert any(p.suffix == ".py" for p in course)  # the public tests, for Colab
    assert _private_content(course, built) == []


@pytest.mark.parametrize("ex", EXERCISES, ids=IDS)
def test_hidden_tests_carry_most_points(ex, built):
    """Hard-coding what the public tests check can earn at most a quarter of an exercise."""
    public = total = 0.0
    with zipfile.ZipFile(built[ex.name].autograder_zip) as zf:
        for name in zf.namelist():
            if name.startswith("tests/") and name.endswith(".py"):
                from otter.test_files import ExceptionTestFile

                tf = ExceptionTestFile.from_string(zf.read(name).decode(), path=name)
                public += sum(tc.points for tc in tf.test_cases if not tc.hidden)
                total += sum(tc.points for tc in tf.test_cases)
    assert 0 < public <= total / 4, f"{ex.name}: public tests carry {public:g} of {total:g} points"


@pytest.mark.parametrize("ex", EXERCISES, ids=IDS)
def test_solution_notebook_keeps_solutions_and_zip_is_gradescope_ready(ex, built):
    b = built[ex.name]
    nb = b.solution_notebook.read_text(encoding="utf-8")
    assert any(s in nb for s in _solution_lines(ex.source))
    hidden = {f for f, _ in _hidden_test_cases(b)}
    with zipfile.ZipFile(b.autograder_zip) as zf:
        names = zf.namelist()
        config = json.loads(zf.read("otter_config.json"))
        env, setup = zf.read("environment.yml").decode(), zf.read("setup.sh").decode()
    assert config["assignment_name"] == ex.name
    assert any("CellTimeLimit" in json.dumps(p) for p in config["plugins"])
    assert len(hidden) >= len(exercises.questions_in(b.autograder_zip))
    # Gradescope builds its image from environment.yml and setup.sh: CPU torch and the course package
    wheel = [n for n in names if re.fullmatch(r"course_lib-[^/]+\.whl", n)]
    assert len(wheel) == 1, names
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in env and "- torch==" in env
    assert f"pip install --no-deps /autograder/source/{wheel[0]}" in setup


# --------------------------------------------------------------------------------------------
# Grading
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graded(grading_batch):
    """Every solution, blank release, mistaken, hard-coded and unstoppable submission graded once,
    three at a time through `course grade`, with the console script on one file and the Gradescope
    runner alongside: the grading batch (tests/grading_batch.py), run beside the rest of the suite."""
    return grading_batch.graded()


def _explain(report) -> str:
    return report.format(verbose=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("ex", EXERCISES, ids=IDS)
def test_instructor_solution_scores_full_marks(graded, ex, built):
    if ex.name == CLI_GRADED:
        _, returncode, stdout, stderr, _, _ = graded["cli"]
        total = sum(exercises.questions_in(built[ex.name].autograder_zip).values())
        assert returncode == 0 and "cell error" not in stdout, stdout + stderr
        assert stdout.strip().splitlines()[-1] == f"TOTAL: {total:g} / {total:g}", stdout
        return
    r = graded["reports"][("solution", ex.name)]
    assert r.error is None, _explain(r)
    assert r.possible > 0 and r.total == r.possible, _explain(r)
    assert r.cell_errors == [], _explain(r)


# GRADESCOPE's blank release is graded by otter's Gradescope runner, and
# test_gradescope_zip_grades_in_a_fresh_environment_with_otters_runner checks that it scores zero
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ex", [e for e in EXERCISES if e.name != GRADESCOPE], ids=lambda e: e.name)
def test_blank_student_release_scores_zero(graded, ex, built):
    r = graded["reports"][("blank", ex.name)]
    assert r.possible == sum(exercises.questions_in(built[ex.name].autograder_zip).values()) > 0
    assert r.total == 0, _explain(r)


MISTAKEN = [(name, q) for name, questions in MISTAKES.items() for q in questions]


def test_every_question_has_a_typical_mistake():
    assert {(ex.name, t.stem) for ex in EXERCISES for t in ex.student_tests.glob("*.py")} == set(MISTAKEN)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,question", MISTAKEN, ids=[f"{n}-{q}" for n, q in MISTAKEN])
def test_a_typical_mistake_loses_its_question_only_with_a_message_that_names_it(graded, name, question):
    r = graded["reports"][("mistake", name, question)]
    assert r.error is None, _explain(r)  # ended by the per-check limits, not the submission's
    _, _, words = MISTAKES[name][question]
    for q in r.questions:
        if q.name != question:  # every other question keeps all of its points
            assert q.score == q.possible, f"{q.name} lost points for a mistake in {question}\n{_explain(r)}"
            continue
        assert q.score < q.possible, f"{q.name} kept its points despite the mistake\n{_explain(r)}"
        assert any(words in msg for msg in q.failures), f"{q.name}: no message with {words!r}\n{_explain(r)}"
        if (name, q.name) in HUNG | ZERO:  # an endless loop, a deadlock, the question's own bug: zero
            assert q.score == 0, _explain(r)


@pytest.mark.timeout(900)
def test_deadlock_and_endless_loop_end_within_the_limit_with_a_message(graded):
    deadlock = graded["reports"][("mistake", "01_collectives", "q1_ring_all_reduce")]
    q = next(q for q in deadlock.questions if q.name == "q1_ring_all_reduce")
    messages = "\n".join(q.failures)
    assert f"within {GRADING_TIMEOUT} s" in messages and re.search(r"rank \d", messages), _explain(deadlock)
    loop = graded["reports"][("mistake", "04_pram", "q1_erew_prefix_sum")]
    q = next(q for q in loop.questions if q.name == "q1_erew_prefix_sum")
    assert all(f"ran longer than {GRADING_TIMEOUT} s" in m for m in q.failures), _explain(loop)
    assert any("TimeoutError" in m for m in loop.cell_errors), _explain(loop)  # the notebook's own cell


@pytest.mark.timeout(900)
def test_a_cell_that_replaces_the_grading_helpers_changes_nothing(graded):
    r = graded["reports"][("mistake", *TAMPERED)]
    q = next(q for q in r.questions if q.name == TAMPERED[1])
    assert q.score == 0 and any("a factor of the world size" in m for m in q.failures), _explain(r)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(HARD_CODED), ids=list(HARD_CODED))
def test_hard_coding_the_public_answers_earns_at_most_a_quarter(graded, name):
    r = graded["reports"][("hard-coded", name)]
    assert r.error is None, _explain(r)
    assert 0 < r.total <= r.possible / 4, _explain(r)  # > 0: the public tests passed, as hard-coded
    assert r.seed == exercises.submission_seed(r.submission) and f"seed {r.seed}" in _explain(r)


@pytest.mark.timeout(900)
def test_each_submission_is_graded_with_its_own_seed(graded):
    seeds = {key: r.seed for key, r in graded["reports"].items()}
    assert all(isinstance(v, int) for v in seeds.values()), seeds
    assert len(set(seeds.values())) == len(seeds)  # different notebooks, different drawn inputs


def test_drawn_inputs_follow_the_seed_the_process_started_with(tmp_path):
    """A cell that sets COURSE_GRADING_SEED cannot choose its inputs: the seed is the one the
    kernel started with; equal seeds draw equal inputs, other seeds others."""
    script = ("import os\nos.environ['COURSE_GRADING_SEED'] = '1'  # what a submission's cell might do\n"
              "from course_lib.exercises import draws\n"
              "print(draws.grading_seed(), draws.rng('q1').random(), draws.seed('q1'))")

    def run(seed):
        env = {**os.environ, "COURSE_GRADING_SEED": str(seed)}
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              check=True).stdout.split()

    first, again, other = run(5), run(5), run(6)
    assert first[0] == "5" and first == again and first[1:] != other[1:]
    from course_lib.exercises import draws

    before = os.environ.get(draws.SEED_ENV)
    with draws.seeded(7):  # what a grading worker starts its kernel under
        assert os.environ[draws.SEED_ENV] == "7"
    assert os.environ.get(draws.SEED_ENV) == before
    sub = tmp_path / "a.ipynb"
    sub.write_text("{}")
    seed = exercises.submission_seed(sub)
    sub.write_text("{} ")
    assert 0 <= seed < 2**31 and exercises.submission_seed(sub) != seed


def test_every_exercise_has_a_hard_coded_submission():
    assert set(HARD_CODED) == {ex.name for ex in EXERCISES}


@pytest.mark.timeout(900)
def test_a_cell_that_defeats_the_cell_limit_costs_only_what_needs_it(graded):
    """Stopped at the submission's limit, the grading starts again without the cell that was
    running: the solution with such a cell scores full marks; stopped again, every question zero."""
    returncode, stdout, stderr = graded["skipped"]
    (once,) = json.loads(stdout)
    assert returncode == 0, stderr
    assert once["error"] is None and once["total"] == once["possible"] > 0, once
    assert once["submission"].endswith("stuck_once/03_zero.ipynb") and once["seconds"] >= SKIPPED_LIMIT, once
    (skipped,) = once["cell_errors"]
    assert skipped.startswith("[# import signal, time] TimeoutError: grading skipped this cell")
    assert f"{SKIPPED_LIMIT} s" in skipped, skipped
    returncode, stdout, stderr, grader_tmp, marked = graded["stopped"]
    (twice,) = json.loads(stdout)
    assert returncode == 1, stderr  # a grading that did not complete
    assert twice["total"] == 0 and f"limit of {STOPPED_LIMIT} s" in twice["error"], twice
    assert "The cell running then starts with: import ctypes, signal" in twice["error"], twice  # which cell
    assert left_behind(STOPPED_MARK, marked) == []  # no kernel runs on, the one blocked in C included
    assert all(f"limit of {STOPPED_LIMIT} s" in q["failures"][0] for q in twice["questions"]), twice
    # the killed workers' copies of the submission (the skipping one's too) and their kernels' files
    # went with their job folders
    assert sorted(p.name for p in grader_tmp.iterdir()) == []


@pytest.mark.timeout(900)
def test_grading_used_no_network_and_no_docker(graded):
    assert graded["guard_log"].read_text() == ""
    assert all(r.error is None for r in graded["reports"].values())


@pytest.mark.timeout(900)
def test_course_grade_command_prints_scores_then_total_for_any_file_name(graded, built):
    """The console script, as an instructor runs it: one line per question, TOTAL last."""
    submission, returncode, stdout, stderr, _, _ = graded["cli"]
    assert returncode == 0, stderr
    zip_path = built[CLI_GRADED].autograder_zip
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines[0].startswith(str(submission))
    for question, points in exercises.questions_in(zip_path).items():
        assert any(re.fullmatch(rf"\s*{question}\s+{points:g} / {points:g}", ln) for ln in lines), stdout
    total = sum(exercises.questions_in(zip_path).values())
    assert lines[-1] == f"TOTAL: {total:g} / {total:g}"


@pytest.mark.timeout(900)
def test_gradebook_csv_has_a_row_per_question_and_a_total(graded, built):
    submission, _, _, _, grades, _ = graded["cli"]
    rows = list(csv.DictReader(grades.open(encoding="utf-8")))
    points = exercises.questions_in(built[CLI_GRADED].autograder_zip)
    assert [r["question"] for r in rows] == [*points, "TOTAL"]
    assert {r["student"] for r in rows} == {submission.stem} and {r["assignment"] for r in rows} == {CLI_GRADED}
    assert [float(r["score"]) for r in rows] == [*points.values(), sum(points.values())]
    assert {r["seed"] for r in rows} == {str(exercises.submission_seed(submission))}  # to grade again: --seed
    # and from reports directly: several students, a failed question
    r = graded["reports"][("mistake", "03_zero", "q2_zero1_step")]
    path = exercises.write_csv([r, graded["reports"][("solution", "03_zero")]], submission.parent / "two.csv")
    rows = list(csv.DictReader(path.open(encoding="utf-8")))
    assert len(rows) == 2 * (len(r.questions) + 1)
    assert rows[len(r.questions)]["question"] == "TOTAL" and float(rows[len(r.questions)]["score"]) == r.total


@pytest.mark.timeout(900)
def test_feedback_is_student_safe(graded, built, tmp_path):
    _, _, _, _, _, folder = graded["cli"]
    (written,) = folder.iterdir()
    assert written.name == Path(CLI_NAME).stem + ".txt" and "TOTAL: 10 / 10" in written.read_text()
    r = graded["reports"][("mistake", "05_nanogpt", "q2_mfu")]
    (path,) = exercises.write_feedback([r], tmp_path)
    text = path.read_text()
    hidden = _hidden_test_cases(built["05_nanogpt"])
    assert "a hidden test failed" in text and "expected" in text  # a public message, and that hidden ones failed
    for func, own in hidden:
        assert func not in text and not [ln for ln in own if len(ln) >= 20 and ln in text], text
    assert "(hidden)" in _explain(r)  # the instructor's report has the details


@pytest.mark.timeout(900)
def test_gradescope_zip_grades_in_a_fresh_environment_with_otters_runner(graded, built):
    returncode, stdout, stderr = graded["gradescope"]
    assert returncode == 0, stderr[-3000:]
    scores = json.loads(stdout.strip().splitlines()[-1])
    total = sum(exercises.questions_in(built[GRADESCOPE].autograder_zip).values())
    for kind, want in (("solution", total), ("blank", 0)):
        s = scores[kind]
        assert "venv" in s["course_lib"], s["course_lib"]  # the zip's wheel, not this checkout
        assert s["possible"] == pytest.approx(total) and s["score"] == pytest.approx(want), s["tail"]


@pytest.mark.timeout(900)
def test_grader_check_passes_for_a_student_who_solved_it(graded, built):
    """In the student folder (public tests as files, no grading mode) grader.check runs the
    public tests; a notebook with correct answers passes every one of them."""
    returncode, stderr, executed = graded["student"]
    assert returncode == 0, stderr
    nb = nbformat.read(executed, as_version=4)
    checks = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith("grader.check(")]
    assert len(checks) == len(exercises.questions_in(built[STUDENT_RUN].autograder_zip))
    for cell in checks:
        text = "".join(o.get("data", {}).get("text/plain", "") for o in cell.outputs)
        assert "All test cases passed!" in text, f"{cell.source}: {text or cell.outputs}"


@pytest.mark.parametrize("ex", EXERCISES, ids=IDS)
def test_every_exercise_names_the_lesson_it_follows(ex):
    intro = nbformat.read(ex.source, as_version=4).cells[0].source
    # the link opens the lesson in Colab: a relative ../../notebooks/ link is dead in a published
    # handout (course exercises publish copies no lessons) and on Colab
    found = re.findall(r"Follows lesson (\d+), \[(\d\d_\w+)\]\((\S+)\) \(in a clone of the course: "
                       r"`notebooks/(\d\d_\w+)\.ipynb`\)", intro)
    assert len(found) == 1, f"{ex.name}: its first cell names no lesson ('Follows lesson N, [NN_topic](...)')"
    number, name, link, path = found[0]
    assert link == colab_url(f"notebooks/{name}.ipynb") and path == name and int(number) == int(name[:2])
    assert (ROOT / "notebooks" / f"{name}.ipynb").is_file()


def test_the_students_readme_lists_the_lesson_each_exercise_follows():
    text = " ".join((ROOT / "exercises" / "README.md").read_text(encoding="utf-8").split())
    (listed,) = re.findall(r"names the lesson it follows in its first cell \((01 after lesson .*?)\)\.", text)
    pairs = dict(re.findall(r"(\d\d) after (?:lesson )?(\d+)", listed))
    follows = {ex.name[:2]: re.search(r"Follows lesson (\d+),", nbformat.read(ex.source, as_version=4).cells[0].source)[1]
               for ex in EXERCISES}
    assert pairs == follows, (pairs, follows)


@pytest.mark.timeout(600)
def test_an_instructor_authors_builds_publishes_and_grades_a_private_exercise(tmp_path, capsys):
    """The README's path for private exercises, in a folder of their own (their private
    repository): `new` from the template, `build`, `check`, `publish`, `grade --root`."""
    root = tmp_path / "my-course" / "instructor"
    assert exercises.cli(["new", "07_mean", "--root", str(root)]) == 0
    assert exercises.cli(["new", "07_mean", "--root", str(root)]) == 2  # never overwrites
    assert exercises.cli(["new", "mean", "--root", str(root)]) == 2  # NN_topic
    (ex,) = exercises.discover(root)
    assert exercises.source_problems(ex) == [] and exercises.setup_cell_problems(ex) == []
    assert exercises.cli(["build", "--root", str(root)]) == 0
    assert exercises.cli(["check", "--root", str(root)]) == 0
    assert ex.release == tmp_path / "my-course" / "exercises" / "07_mean" and ex.autograder_zip.is_file()
    out = tmp_path / "published"
    assert exercises.cli(["publish", str(out), "--root", str(root)]) == 0
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["README.md", "exercises/07_mean/07_mean.ipynb", "exercises/07_mean/MANIFEST.json",
                     "exercises/07_mean/tests/q1_mean.py"], files
    text = "\n".join((out / f).read_text() for f in files)
    assert "sum(values) / len(values)" not in text and "HIDDEN" not in text and "test_drawn_lists" not in text
    assert exercises.cli(["publish", str(out), "--root", str(root)]) == 1  # not into a full folder

    hard_coded = tmp_path / "hard_coded.ipynb"
    patched(ex.solution_notebook, {"    return sum(values) / len(values)  # SOLUTION\n": "    return 2.5\n"},
             tmp_path, hard_coded.name)
    # the kernel that runs the tests sees the seed that the report records
    says_seed = patched(ex.solution_notebook, {}, tmp_path / "seed", first_cell=(
        "from course_lib.exercises import draws\nraise RuntimeError(f'drawn with seed {draws.grading_seed()}')"))
    capsys.readouterr()
    subs = [ex.solution_notebook, out / "exercises" / "07_mean" / "07_mean.ipynb", hard_coded, says_seed]
    assert exercises.grade_cli([*map(str, subs), "--root", str(root), "--jobs", "4", "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [(r["total"], r["possible"]) for r in reports] == [(4, 4), (0, 4), (1, 4), (4, 4)], reports
    assert [r["seed"] for r in reports] == [exercises.submission_seed(s) for s in subs]
    assert any(f"drawn with seed {reports[3]['seed']}" in e for e in reports[3]["cell_errors"]), reports[3]
