"""The graded exercises: dist/ is fresh, student releases leak nothing, and grading scores right.

    python -m pytest tests/test_exercises.py -q

Grading goes through otter-grader's own code path (``otter run`` without Docker) in two worker
processes: every instructor solution must score full marks, every blank student release zero, a
plausible wrong answer must lose exactly the points of the question it breaks, and an answer in
which one rank never joins the collective must time out with a message. The gradings run with
an audit hook (a ``sitecustomize`` on PYTHONPATH, inherited by otter, the kernels it starts and
the ranks they fork) that refuses and records any connection to a non-loopback host and any
attempt to start Docker.
"""

from __future__ import annotations

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

from course_lib import exercises

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = exercises.discover(ROOT / "exercises")
IDS = [e.name for e in EXERCISES]
BY_NAME = {e.name: e for e in EXERCISES}

# Seconds a multi-rank grading helper waits for the ranks. The course default is generous for
# busy JupyterHub nodes; here it bounds how long the hanging answer keeps a worker busy.
GRADING_TIMEOUT = "12"

# (exercise, question it breaks, text in the solution notebook, wrong replacement, why plausible)
WRONG_ANSWERS = [
    ("01_collectives", "q1_ring_all_reduce",
     ("        request = dist.isend(chunks[send_index].contiguous(), right)\n"
      "        dist.recv(incoming, left)\n"
      "        request.wait()\n"),
     ("        dist.recv(incoming, left)  # every rank waits to receive before anyone sends\n"
      "        dist.send(chunks[send_index].contiguous(), right)\n"),
     "hang: blocking receive before send on every rank, a deadlock around the ring"),
    ("02_data_parallel", "q1_average_gradients",
     "            p.grad /= world_size\n", "",
     "sums the gradients instead of averaging them"),
    ("03_zero", "q1_memory",
     "    grads = 2 * psi / (n_d if stage >= 2 else 1)\n",
     "    grads = 2 * psi / (n_d if stage >= 3 else 1)\n",
     "gradients partitioned only from stage 3"),
    ("04_pram", "q1_erew_prefix_sum",
     '            mem["A"][pid] = mem["A"][pid] + mem["B"][pid - d]\n',
     '            mem["A"][pid] = mem["A"][pid] + mem["A"][pid - d]\n',
     "reads A[i - d] directly (Hillis-Steele in place): a concurrent read, not EREW"),
    ("05_nanogpt", "q3_resume",
     '    torch.set_rng_state(state["rng"])\n', "",
     "resumes without the RNG state: different batches and dropout masks"),
    ("06_model_parallel", "q1_vocab_parallel_cross_entropy",
     "    dist.all_reduce(m, op=dist.ReduceOp.MAX)  # the maximum over the whole vocabulary\n", "",
     "each rank shifts by its own maximum: the sum of exponentials mixes different shifts"),
]
HANGING = "01_collectives"
CLI_GRADED = "04_pram"  # its solution is graded through the `course grade` console script
STUDENT_RUN = "02_data_parallel"  # run as a student would, grader.check in every check cell

EXECUTE = """
import sys, nbformat
from nbclient import NotebookClient
path, out = sys.argv[1], sys.argv[2]
nb = nbformat.read(path, as_version=4)
NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
               resources={"metadata": {"path": str(__import__("pathlib").Path(path).parent)}}).execute()
nbformat.write(nb, out)
"""

GUARD = '''\
"""Test guard (tests/test_exercises.py): refuse and record network and Docker use."""
import os, socket, sys

_LOG = os.environ.get("COURSE_TEST_GUARD_LOG")
_LOCAL = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "", socket.gethostname()}


def _local(host):
    host = host.decode() if isinstance(host, bytes) else str(host)
    return host in _LOCAL or host.startswith("127.")


def _refuse(what):
    with open(_LOG, "a") as f:
        f.write(f"{os.getpid()} {what}\\n")
    raise PermissionError(f"test guard: {what} refused (grading must need no network and no Docker)")


def _hook(event, args):
    if event == "socket.connect":
        address = args[1]
        if isinstance(address, tuple) and not _local(address[0]):
            _refuse(f"connect to {address}")
    elif event == "socket.getaddrinfo":
        if args[0] is not None and not _local(args[0]):
            _refuse(f"resolve {args[0]}")
    elif event == "urllib.Request":
        _refuse(f"urllib request {args[0]}")
    elif event == "subprocess.Popen":
        argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        if any("docker" in os.path.basename(str(a)) for a in [args[0], *argv[:1]]):
            _refuse(f"start {args[0]} {argv}")


if _LOG:
    sys.addaudithook(_hook)
'''


# --------------------------------------------------------------------------------------------
# The releases on disk
# --------------------------------------------------------------------------------------------

def test_at_least_five_exercises_in_order():
    assert len(EXERCISES) >= 5
    assert [e.name[:3] for e in EXERCISES] == [f"{i:02d}_" for i in range(1, len(EXERCISES) + 1)]


@pytest.mark.parametrize("ex", EXERCISES, ids=IDS)
def test_source_is_clean_and_dist_is_fresh(ex):
    assert exercises.source_problems(ex) == []  # committed without outputs
    assert exercises.setup_cell_problems(ex) == []  # installs on Colab only, current repository
    assert exercises.check(ex) == []  # dist/ was built from this source and not edited since


@pytest.mark.timeout(180)
def test_rebuild_reproduces_committed_dist(tmp_path):
    """otter assign on copies of the sources gives dist/ byte for byte: the manifest is honest
    and a rebuild after an edit shows as a clean diff."""
    for ex in EXERCISES:
        (tmp_path / ex.name).mkdir()
        shutil.copy2(ex.source, tmp_path / ex.name / ex.source.name)
    for copy in exercises.discover(tmp_path):
        exercises.build(copy)
        original = BY_NAME[copy.name]
        built = sorted(p.relative_to(copy.dist) for p in copy.dist.rglob("*") if p.is_file())
        committed = sorted(p.relative_to(original.dist) for p in original.dist.rglob("*") if p.is_file())
        assert built == committed, f"{copy.name}: rebuilt files differ from the committed ones"
        for rel in built:
            assert (copy.dist / rel).read_bytes() == (original.dist / rel).read_bytes(), \
                f"{copy.name}: dist/{rel} is stale; run `make exercises`"


def test_check_reports_stale_and_hand_edited_dist(tmp_path):
    src = EXERCISES[-1]
    shutil.copytree(src.dir, tmp_path / src.name)
    ex = exercises.discover(tmp_path)[0]
    assert exercises.check(ex) == []

    student = ex.student_notebook
    student.write_text(student.read_text().replace("grader.check", "grader.check "), encoding="utf-8")
    assert any("edited by hand" in m for m in exercises.check(ex))
    shutil.copy2(src.student_notebook, student)

    (ex.dist / "student" / "notes.txt").write_text("extra")
    assert any("not written by the build" in m for m in exercises.check(ex))
    (ex.dist / "student" / "notes.txt").unlink()

    nb = nbformat.read(ex.source, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("One more paragraph."))
    nbformat.write(nb, ex.source)
    assert any("changed since dist/ was built" in m for m in exercises.check(ex))

    (ex.dist / exercises.MANIFEST).unlink()
    assert any("run `course exercises build" in m for m in exercises.check(ex))


def test_sync_rewrites_badge_and_setup_cell(tmp_path):
    src = EXERCISES[1]
    (tmp_path / src.name).mkdir()
    shutil.copy2(src.source, tmp_path / src.name / src.source.name)
    ex = exercises.discover(tmp_path)[0]
    nb = nbformat.read(ex.source, as_version=4)
    md = next(c for c in nb.cells if c.cell_type == "markdown")
    code = next(c for c in nb.cells if c.cell_type == "code")
    from course_lib import GITHUB_REPO

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
        exercises.build(ex)
    assert not ex.dist.exists()


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
def test_student_release_has_no_solutions_and_no_hidden_tests(ex):
    student_files = [p for p in (ex.dist / "student").rglob("*") if p.is_file()]
    assert {p.relative_to(ex.dist / "student").parts[0] for p in student_files} == {ex.source.name, "tests"}
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

    hidden = _hidden_test_cases(ex)
    assert hidden, f"{ex.name}: the autograder has no hidden tests"
    for func, own_lines in hidden:
        assert func not in text, f"{ex.name}: hidden test {func} is in the student release"
        shown = [ln for ln in own_lines if len(ln) >= 30 and ln in lines]
        assert not shown, f"{ex.name}: lines of hidden test {func} are in the student release: {shown[:2]}"

    # every question has its public tests next to the student notebook
    questions = exercises.questions_in(ex.autograder_zip)
    assert {p.stem for p in (ex.dist / "student" / "tests").glob("*.py")} == set(questions)


@pytest.mark.parametrize("ex", EXERCISES, ids=IDS)
def test_solution_notebook_keeps_solutions_and_zip_has_all_tests(ex):
    nb = ex.solution_notebook.read_text(encoding="utf-8")
    assert any(s in nb for s in _solution_lines(ex.source))
    hidden = {f for f, _ in _hidden_test_cases(ex)}
    with zipfile.ZipFile(ex.autograder_zip) as zf:
        assert "otter_config.json" in zf.namelist()
        config = json.loads(zf.read("otter_config.json"))
    assert config["assignment_name"] == ex.name
    assert any("CellTimeLimit" in json.dumps(p) for p in config["plugins"])
    assert len(hidden) >= len(exercises.questions_in(ex.autograder_zip))


def test_fetch_student_tests_from_a_copy_of_the_repository(tmp_path):
    """What the Colab setup cell does, against file:// instead of raw.githubusercontent.com."""
    ex = EXERCISES[0]
    written = exercises.fetch_student_tests(ex.name, tmp_path / "tests", base_url=ROOT.as_uri())
    assert sorted(p.name for p in written) == sorted(p.name for p in (ex.dist / "student" / "tests").glob("*.py"))
    for p in written:
        assert p.read_bytes() == (ex.dist / "student" / "tests" / p.name).read_bytes()


# --------------------------------------------------------------------------------------------
# Grading
# --------------------------------------------------------------------------------------------

def _wrong_notebook(ex, old: str, new: str, dest: Path) -> Path:
    nb = nbformat.read(ex.solution_notebook, as_version=4)
    hits = [c for c in nb.cells if c.cell_type == "code" and old in c.source]
    assert len(hits) == 1, f"{ex.name}: the wrong-answer patch no longer matches the solution"
    hits[0].source = hits[0].source.replace(old, new)
    dest.mkdir(parents=True)
    path = dest / ex.solution_notebook.name
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade every solution, blank release and wrong answer once, two at a time."""
    tmp = tmp_path_factory.mktemp("grading")
    guard_dir, guard_log = tmp / "guard", tmp / "guard.log"
    guard_dir.mkdir()
    (guard_dir / "sitecustomize.py").write_text(GUARD)
    guard_log.touch()

    jobs = []  # (key, submission, autograder zip)
    for ex in EXERCISES:
        if ex.name != CLI_GRADED:
            jobs.append((("solution", ex.name), ex.solution_notebook, ex.autograder_zip))
        jobs.append((("blank", ex.name), ex.student_notebook, ex.autograder_zip))
    for name, question, old, new, _ in WRONG_ANSWERS:
        ex = BY_NAME[name]
        path = _wrong_notebook(ex, old, new, tmp / f"wrong_{name}")
        jobs.append((("wrong", name), path, ex.autograder_zip))
    # the slowest (the hanging answer) first, so the other worker gets through the rest meanwhile
    jobs.sort(key=lambda j: j[0] != ("wrong", HANGING))

    env = {"PYTHONPATH": os.pathsep.join([str(guard_dir), os.environ.get("PYTHONPATH", "")]),
           "COURSE_TEST_GUARD_LOG": str(guard_log), "COURSE_GRADING_TIMEOUT": GRADING_TIMEOUT}
    # The console script, as an instructor runs it, alongside the pool (tested below).
    cli_sub = BY_NAME[CLI_GRADED].solution_notebook
    cli = subprocess.Popen([str(Path(sys.executable).with_name("course")), "grade", str(cli_sub)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp,
                           env={**os.environ, **env})
    # A student who solved STUDENT_RUN: the solutions in the student folder (public tests only).
    student_dir = tmp / "student"
    shutil.copytree(BY_NAME[STUDENT_RUN].dist / "student", student_dir)
    solved = student_dir / BY_NAME[STUDENT_RUN].source.name
    shutil.copy2(BY_NAME[STUDENT_RUN].solution_notebook, solved)
    student = subprocess.Popen([sys.executable, "-c", EXECUTE, str(solved), str(tmp / "executed.ipynb")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **env})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # three workers on two cores: the one grading the hanging answer mostly waits
        reports = exercises.grade_many([j[1] for j in jobs], [j[2] for j in jobs], jobs=3)
        cli_out, cli_err = cli.communicate(timeout=300)
        _, student_err = student.communicate(timeout=300)
    finally:
        cli.kill()
        student.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"reports": {j[0]: r for j, r in zip(jobs, reports)}, "guard_log": guard_log,
            "cli": (cli_sub, cli.returncode, cli_out, cli_err),
            "student": (student.returncode, student_err, tmp / "executed.ipynb")}


def _explain(report) -> str:
    return report.format(verbose=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ex", EXERCISES, ids=IDS)
def test_instructor_solution_scores_full_marks(graded, ex):
    if ex.name == CLI_GRADED:
        _, returncode, stdout, stderr = graded["cli"]
        total = sum(exercises.questions_in(ex.autograder_zip).values())
        assert returncode == 0 and "cell error" not in stdout, stdout + stderr
        assert stdout.strip().splitlines()[-1] == f"TOTAL: {total:g} / {total:g}", stdout
        return
    r = graded["reports"][("solution", ex.name)]
    assert r.error is None, _explain(r)
    assert r.possible > 0 and r.total == r.possible, _explain(r)
    assert r.cell_errors == [], _explain(r)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ex", EXERCISES, ids=IDS)
def test_blank_student_release_scores_zero(graded, ex):
    r = graded["reports"][("blank", ex.name)]
    assert r.possible == sum(exercises.questions_in(ex.autograder_zip).values()) > 0
    assert r.total == 0, _explain(r)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", WRONG_ANSWERS, ids=[c[0] for c in WRONG_ANSWERS])
def test_wrong_answer_loses_only_the_question_it_breaks(graded, case):
    name, question, _, _, why = case
    r = graded["reports"][("wrong", name)]
    for q in r.questions:
        if q.name == question:
            assert q.score < q.possible, f"{why}: {question} kept its points\n{_explain(r)}"
            assert q.failures, _explain(r)
        else:
            assert q.score == q.possible, f"{why}: {q.name} lost points too\n{_explain(r)}"


@pytest.mark.timeout(600)
def test_hanging_answer_times_out_with_a_message(graded):
    r = graded["reports"][("wrong", HANGING)]
    q = next(q for q in r.questions if q.name == "q1_ring_all_reduce")
    assert q.score == 0, _explain(r)
    messages = "\n".join(q.failures + r.cell_errors)
    assert "TimeoutError" in messages and f"within {GRADING_TIMEOUT} s" in messages, _explain(r)
    assert "never joined" in messages and re.search(r"rank \d", messages), _explain(r)


@pytest.mark.timeout(600)
def test_grading_used_no_network_and_no_docker(graded):
    assert graded["guard_log"].read_text() == ""
    assert all(r.error is None for r in graded["reports"].values())


@pytest.mark.timeout(600)
def test_course_grade_command_prints_scores_then_total(graded):
    """The console script, as an instructor runs it: one line per question, TOTAL last."""
    submission, returncode, stdout, stderr = graded["cli"]
    assert returncode == 0, stderr
    zip_path = BY_NAME[CLI_GRADED].autograder_zip
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines[0].startswith(str(submission))
    for question, points in exercises.questions_in(zip_path).items():
        assert any(re.fullmatch(rf"\s*{question}\s+{points:g} / {points:g}", ln) for ln in lines), stdout
    total = sum(exercises.questions_in(zip_path).values())
    assert lines[-1] == f"TOTAL: {total:g} / {total:g}"


@pytest.mark.timeout(600)
def test_grader_check_passes_for_a_student_who_solved_it(graded):
    """In the student folder (public tests as files, no grading mode) grader.check runs the
    public tests; a notebook with correct answers passes every one of them."""
    returncode, stderr, executed = graded["student"]
    assert returncode == 0, stderr
    nb = nbformat.read(executed, as_version=4)
    checks = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith("grader.check(")]
    assert len(checks) == len(exercises.questions_in(BY_NAME[STUDENT_RUN].autograder_zip))
    for cell in checks:
        text = "".join(o.get("data", {}).get("text/plain", "") for o in cell.outputs)
        assert "All test cases passed!" in text, f"{cell.source}: {text or cell.outputs}"


def test_course_grade_refuses_bad_input(tmp_path, capsys):
    assert exercises.grade_cli([str(tmp_path / "missing.ipynb")]) == 2
    assert "does not exist" in capsys.readouterr().err
    plain = tmp_path / "plain.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), plain)
    assert exercises.grade_cli([str(plain)]) == 2
    assert "assignment name" in capsys.readouterr().err
    assert exercises.grade_cli([str(plain), "--cell-timeout", "0"]) == 2


# --------------------------------------------------------------------------------------------
# The grading helpers on their own
# --------------------------------------------------------------------------------------------

def _deadlock(rank, world_size):
    import torch
    import torch.distributed as dist

    buf = torch.empty(2)
    dist.recv(buf, (rank - 1) % world_size)  # every rank receives first: nobody ever sends
    dist.send(buf, (rank + 1) % world_size)


def _boom(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _p2p(rank, world_size):
    import torch
    import torch.distributed as dist

    from course_lib.exercises.grading import p2p_only

    with p2p_only() as sent:
        if rank == 0:
            dist.send(torch.zeros(5, dtype=torch.float64), 1)
        else:
            dist.recv(torch.empty(5, dtype=torch.float64), 0)
        try:
            dist.all_reduce(torch.ones(1))
            refused = ""
        except RuntimeError as e:
            refused = str(e)
    x = torch.ones(1)
    dist.all_reduce(x)  # restored on exit
    return sent.bytes, refused, x.item()


@pytest.mark.timeout(120)
def test_run_ranks_bounds_hangs_and_reports_failures():
    from course_lib.exercises.grading import RankError, RanksTimeoutError, run_ranks

    for bad in ({"nproc": 0}, {"nproc": 2, "timeout": 0}, {"nproc": 99}):
        with pytest.raises(ValueError):
            run_ranks(_boom, **bad)
    with pytest.raises(RanksTimeoutError, match=r"within 2 s .*never joined"):
        run_ranks(_deadlock, 2, timeout=2)
    with pytest.raises(RankError, match="boom on rank 1"):
        run_ranks(_boom, 2, timeout=30)
    (b0, refused0, total0), (b1, _, total1) = run_ranks(_p2p, 2, timeout=30)
    assert (b0, b1) == (40, 0) and "not allowed" in refused0 and total0 == total1 == 2.0


@pytest.mark.timeout(120)
def test_cell_time_limit_stops_an_endless_cell_and_grading_goes_on():
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("while True:\n    pass"),
        nbformat.v4.new_code_cell("y = x + 1\ny"),
    ])
    plugin = exercises.CellTimeLimit("sub.ipynb", {}, {"cell_timeout": 2})
    nb = plugin.before_execution(nb)
    nb.cells.append(nbformat.v4.new_code_cell("import time\ntime.sleep(3)\n'tests ran'"))  # otter's cell
    NotebookClient(nb, timeout=60, kernel_name="python3", allow_errors=True).execute()
    loop, after, last = nb.cells[2], nb.cells[3], nb.cells[-1]
    assert loop.outputs[0]["ename"] == "TimeoutError" and "longer than 2 s" in loop.outputs[0]["evalue"]
    assert after.outputs[0]["data"]["text/plain"] == "2"
    assert last.outputs[0]["data"]["text/plain"] == "'tests ran'"  # disarmed before otter's cells
