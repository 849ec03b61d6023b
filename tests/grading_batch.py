"""The grading batch of tests/test_exercises.py, run beside the rest of the suite at a lower priority.

    python -m pytest tests/test_exercises.py -q    # the batch, then the module's checks of its reports

Grading every exercise's solution, blank release, typical mistakes, hard-coded answers and
unstoppable cells is about 55 gradings of 7 CPU-seconds each: alone, the 2-core machine spent
210-230 s of the suite on it, busy on both cores, while most of the other tests left one core idle
(a kernel waiting for its ranks, a browser for a page). So tests/conftest.py starts this batch with
the session's first test, in a thread of its own, and every process of it runs under Linux's
``SCHED_IDLE`` policy (``chrt --idle 0``): it gets a core only when no other test wants it, and a
test's process that wakes up takes the core from it at once. The lessons, which keep both cores
busy, run after the other modules, and test_exercises.py last, when the batch is done.

Measured on the 2-core machine, the whole suite: 886 s with the gradings in the middle as before;
872 s with the batch beside everything at ``nice 10`` (the scheduler weighs each process, and its
twenty-odd processes took half the CPU from the three lessons running at once: 327 s instead of
138 s); with the lessons after it, 772 s at ``nice 19`` and 792 s at ``SCHED_IDLE``. Beside the
batch the tests with ranks still ran two to three times slower (comm_bench's two gloo ranks 11-16 s
against 4.9 s alone), at either priority, though two CPU-bound loops at either priority beside them
cost nothing (4.4 s): what slows them is not the batch's share of the CPU but something else it
does (it starts processes and imports torch without end; not pinned down further). Three
gradings at once (``JOBS``) instead of six slow them less: fresh clones took 799 s with six and
755 s with three.

Its limits are wider than a grader would set (``GRADING_TIMEOUT``, ``CELL_TIMEOUT``, the time
limits below): a grading waits while the other tests keep both cores busy (at most 12 s at a time
outside the lessons, measured), and a limit may only stop what a test means it to stop. The
hanging answers wait them out asleep, in the background.

Every process of the batch carries ``BACKGROUND_MARK`` in its environment, so that a test that
counts the processes it started leaves these out (kernel_cells.spawned_here).
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
from kernel_cells import BACKGROUND_MARK

from course_lib import exercises

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = exercises.discover(ROOT / exercises.SOURCES)
BY_NAME = {e.name: e for e in EXERCISES}

IDLE = ["chrt", "--idle", "0"]  # SCHED_IDLE: the CPU that no other process wants (the docstring)
# Seconds a checked call (isolated check, multi-rank run) may take while grading here, and any cell
# (the module docstring: wide, since the batch may wait behind other tests; the hanging answers
# wait them out in the background). A grading cell runs a question's three checks: an endless
# answer waits out three checked calls before its cell's own limit.
GRADING_TIMEOUT = "40"
CELL_TIMEOUT = "180"
BATCH_TIME_LIMIT = 900  # s, one grading of one submission of the batch
SKIPPED_LIMIT = 300  # s, `course grade --time-limit` of the submission whose stuck cell is skipped
STOPPED_LIMIT = 120  # s, and of the one stopped twice: room to reach its stuck cell when starved
WAIT_S = 1800  # s, the most any process of the batch may take (it took 330-370 s beside the suite)
JOBS = 3  # gradings at once: the suite took 755 s with 3, 792 s with 6 (both beside the same tests)

# The cell of the TAMPERED submission: it replaces the grading helpers before the answers run.
TAMPER = ("import course_lib.exercises.grading as _g\n"
          "_g.assert_close = lambda *a, **k: None\n"
          "_g.assert_number = lambda *a, **k: None\n"
          "_g.isolated = lambda check, *a, **k: None\n")
# Submissions built by patching the solutions: they quote solution lines, so they live with the
# sources in instructor/grading_cases.py (MISTAKES: a typical mistake per question, each its own submission;
# HARD_CODED: per exercise, the public answers hard-coded; HUNG: questions whose mistake never
# ends; ZERO: mistakes that must cost all of their question's points; TAMPERED: the (exercise,
# question) whose submission also gets the TAMPER cell).
CASES = runpy.run_path(str(ROOT / exercises.SOURCES / "grading_cases.py"))
MISTAKES, HARD_CODED, HUNG, ZERO, TAMPERED = (CASES[k] for k in ("MISTAKES", "HARD_CODED", "HUNG", "ZERO", "TAMPERED"))
CLI_GRADED = "04_pram"  # its solution is graded through the `course grade` console script
CLI_NAME = "Jane Doe - ex4 (final).ipynb"  # any file name: the assignment is in the metadata
STUDENT_RUN = "02_data_parallel"  # run as a student would, grader.check in every check cell
GRADESCOPE = "04_pram"  # its zip is run by otter's runner in a fresh virtual environment
STOPPED_MARK = "COURSE_TEST_STOPPED_GRADING"  # in the environment of every process the stopped grading starts

EXECUTE = """
import sys, nbformat
from course_lib.exercises.runner import NotebookRunner
path, out = sys.argv[1], sys.argv[2]
nb = nbformat.read(path, as_version=4)
NotebookRunner(nb, timeout=300, kernel_name="python3", allow_errors=True,
               resources={"metadata": {"path": str(__import__("pathlib").Path(path).parent)}}).execute()
nbformat.write(nb, out)
"""

BUILD = """
import shutil, sys
from pathlib import Path
from course_lib import exercises
from course_lib.exercises.build import course_wheel
tmp = Path(sys.argv[1])
for source in sys.argv[2:]:
    source = Path(source)
    (tmp / exercises.SOURCES / source.parent.name).mkdir(parents=True)
    shutil.copy2(source, tmp / exercises.SOURCES / source.parent.name / source.name)
wheel = course_wheel(tmp / "wheel")
for copy in exercises.discover(tmp / exercises.SOURCES):
    exercises.build_exercise(copy, wheel=wheel)
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

STUCK = ("import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)  # the cell limit, switched off\n"
         "while True:\n    try:\n        time.sleep(0.1)  # asleep: no CPU\n    except BaseException:\n        pass")
# Blocked in C holding the GIL (ctypes.PyDLL keeps it), asleep: an orphaned kernel could not even
# notice that its grading worker was killed (ipykernel watches its parent from a thread).
STUCK_IN_C = ("import ctypes, signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)  # the cell limit, switched off\n"
              "ctypes.PyDLL(None).sleep(3600)  # in C, holding the GIL")


def patched(solution: Path, patches: dict[str, str], dest: Path, name: str | None = None,
            first_cell: str | None = None) -> Path:
    """The solution notebook with each ``old`` text replaced by ``new`` (each must occur once)."""
    nb = nbformat.read(solution, as_version=4)
    for old, new in patches.items():
        hits = [c for c in nb.cells if c.cell_type == "code" and old in c.source]
        assert len(hits) == 1, f"{solution.name}: the patch no longer matches the solution: {old!r}"
        hits[0].source = hits[0].source.replace(old, new)
    if first_cell is not None:  # right after the setup cell
        setup = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        nb.cells.insert(setup + 1, nbformat.v4.new_code_cell(first_cell))
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / (name or solution.name)
    nbformat.write(nb, path)
    return path


def _gradescope_script(zip_path: Path, submissions: dict[str, Path], tmp: Path) -> str:
    """A fresh venv that sees this environment's packages through a .pth file, the zip's own
    course_lib wheel installed into it (as its setup.sh does), then otter's Gradescope runner on
    each submission in a /autograder-like folder. Prints one JSON line of scores."""
    return f"""
import json, os, shutil, subprocess, sys, zipfile, venv
from pathlib import Path
tmp, zip_path = Path({str(tmp)!r}), Path({str(zip_path)!r})
venv.EnvBuilder(with_pip=False).create(tmp / "venv")
py = tmp / "venv" / "bin" / "python"
site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                      capture_output=True, text=True, check=True).stdout.strip()
Path(site, "_course_parent_env.pth").write_text({sysconfig.get_paths()["purelib"]!r} + "\\n")
scores = {{}}
for kind, sub in {json.dumps({k: str(v) for k, v in submissions.items()})}.items():
    ag = tmp / ("autograder_" + kind)
    (ag / "submission").mkdir(parents=True)
    (ag / "results").mkdir()
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(ag / "source")
    wheel = next((ag / "source").glob("course_lib-*.whl"))
    if not any(Path(site).glob("course_lib-*.dist-info")):  # what the zip's setup.sh does
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--target", site, str(wheel)], check=True)
    shutil.copy2(sub, ag / "submission" / Path(sub).name)
    (ag / "submission_metadata.json").write_text("{{}}")
    done = subprocess.run([str(py), "-c", "import sys, course_lib; from otter.run.run_autograder import main; "
                           "print('course_lib from', course_lib.__file__); main(sys.argv[1])", str(ag)],
                          capture_output=True, text=True)
    results = ag / "results" / "results.json"
    out = json.loads(results.read_text()) if results.is_file() else {{}}
    where = next((ln for ln in done.stdout.splitlines() if ln.startswith("course_lib from")), "")
    scores[kind] = {{"score": sum(t.get("score", 0) for t in out.get("tests", [])),
                    "possible": sum(t.get("max_score", 0) for t in out.get("tests", [])),
                    "course_lib": where, "rc": done.returncode, "tail": (done.stdout + done.stderr)[-3000:]}}
print(json.dumps(scores))
"""


class GradingBatch:
    """Every grading of test_exercises.py, started at once in a thread of its own (the module
    docstring). ``built()`` waits for the exercises' build, ``graded()`` for every grading; a
    failure of the batch is raised there, in the tests that need it."""

    def __init__(self, tmp: Path, grade: bool = True):
        self.tmp, self.grade = tmp, grade
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._built = threading.Event()
        self._result: dict | None = None
        self._error: BaseException | None = None  # what stopped the batch, raised in the tests
        self._thread = threading.Thread(target=self._run, name="grading batch", daemon=True)

    def start(self) -> GradingBatch:
        self._thread.start()
        return self

    def built(self) -> tuple[dict, Path]:
        """{exercise name: its copy, built as `make exercises` does}, and the one course_lib wheel."""
        self._built.wait()
        self._raise()
        copies = exercises.discover(self.tmp / "built" / exercises.SOURCES)
        return {ex.name: ex for ex in copies}, next((self.tmp / "built" / "wheel").glob("course_lib-*.whl"))

    def graded(self) -> dict:
        self._thread.join()
        self._raise()
        return self._result

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError("the grading batch failed") from self._error

    def stop(self) -> None:
        """Kill what still runs (a session ended early): each process leads a session of its own."""
        with self._lock:
            self._stopping = True
            for p in self._procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ in the batch's thread

    def _popen(self, argv: list[str], env: dict, **kw) -> subprocess.Popen:
        with self._lock:
            if self._stopping:
                raise RuntimeError("the session ended before the grading batch")
            p = subprocess.Popen([*IDLE, *argv], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env={**env, BACKGROUND_MARK: "1"},
                                 start_new_session=True, **kw)
            self._procs.append(p)
            return p

    def _wait(self, p: subprocess.Popen) -> tuple[str, str]:
        """(stdout, stderr) of ``p``; killed, with a line saying so, if it runs past ``WAIT_S``."""
        try:
            return p.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            return out, f"{err}\n[grading_batch: killed after {WAIT_S} s]"

    def _run(self) -> None:
        try:
            build = self._popen([sys.executable, "-c", BUILD, str(self.tmp / "built"),
                                 *(str(ex.source) for ex in EXERCISES)], dict(os.environ))
            _, err = self._wait(build)
            if build.returncode != 0:
                raise RuntimeError(f"building the exercises failed:\n{err[-3000:]}")
            self._built.set()
            if self.grade:
                self._result = self._grade(self.built()[0])
        except BaseException as e:  # noqa: BLE001 (raised in the tests that wait for the batch)
            self._error = e
        finally:
            self._built.set()

    def _grade(self, built: dict) -> dict:
        tmp = self.tmp / "grading"
        guard_dir, guard_log = tmp / "guard", tmp / "guard.log"
        guard_dir.mkdir(parents=True)
        (guard_dir / "sitecustomize.py").write_text(GUARD)
        guard_log.touch()

        jobs = []  # (key, submission)
        for name, ex in built.items():
            if name != CLI_GRADED:
                jobs.append((("solution", name), ex.solution_notebook))
            if name != GRADESCOPE:  # its blank release is graded by the Gradescope runner below
                jobs.append((("blank", name), ex.student_notebook))
        for name, questions in MISTAKES.items():  # one submission per question: only it is wrong
            for question, (old, new, _) in questions.items():
                path = patched(built[name].solution_notebook, {old: new}, tmp / f"mistake_{name}_{question}",
                               first_cell=TAMPER if (name, question) == TAMPERED else None)
                jobs.append((("mistake", name, question), path))
        for name, patches in HARD_CODED.items():
            jobs.append((("hard-coded", name), patched(built[name].solution_notebook, patches,
                                                       tmp / f"hard_coded_{name}")))
        # the slowest (the hanging answers) first, so the other workers get through the rest meanwhile
        jobs.sort(key=lambda j: j[0][1:] not in HUNG)

        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join([str(guard_dir), os.environ.get("PYTHONPATH", "")]),
               "COURSE_TEST_GUARD_LOG": str(guard_log), "COURSE_GRADING_TIMEOUT": GRADING_TIMEOUT,
               "COURSE_GRADING_CELL_TIMEOUT": CELL_TIMEOUT}
        course = str(Path(sys.executable).with_name("course"))
        root = str(self.tmp / "built" / exercises.SOURCES)  # where `course grade` finds each autograder
        # The batch: the console script, as an instructor runs it on a folder of submissions.
        batch = self._popen([course, "grade", *(str(j[1]) for j in jobs), "--root", root, "--jobs", str(JOBS),
                             "--time-limit", str(BATCH_TIME_LIMIT), "--json"], env, cwd=tmp)
        # Again, on a file named anything, with a gradebook and feedback; and on a cell that defeats
        # the cell limit, stopped by --time-limit.
        cli_sub = shutil.copy2(built[CLI_GRADED].solution_notebook, tmp / CLI_NAME)
        cli = self._popen([course, "grade", str(cli_sub), "--autograder", str(built[CLI_GRADED].autograder_zip),
                           "--csv", str(tmp / "grades.csv"), "--feedback", str(tmp / "feedback")], env, cwd=tmp)
        # Cells the cell limit cannot stop (as one that blocks in C code): in the solution, graded again
        # without it; in the blank release twice over, so the second grading is stopped too.
        stuck_once = patched(built["03_zero"].solution_notebook, {}, tmp / "stuck_once", first_cell=STUCK)
        stuck_twice = patched(built["03_zero"].student_notebook, {}, tmp / "stuck_twice", first_cell=STUCK_IN_C)
        nb = nbformat.read(stuck_twice, as_version=4)
        nb.cells.append(nbformat.v4.new_code_cell(STUCK))
        nbformat.write(nb, stuck_twice)
        # the grader's temporary folder: the killed sessions must leave it empty; a long path, as on a
        # cluster, where a worker's fork-server socket would not fit (the solution's ranks must still run)
        stopper_tmp = tmp / "stopper_tmp_as_long_as_a_cluster_jobs_scratch_folder"
        stopper_tmp.mkdir()
        zero_zip = str(built["03_zero"].autograder_zip)
        skipper = self._popen([course, "grade", str(stuck_once), "--autograder", zero_zip,
                               "--time-limit", str(SKIPPED_LIMIT), "--json"], {**env, "TMPDIR": str(stopper_tmp)},
                              cwd=tmp)
        stopper = self._popen([course, "grade", str(stuck_twice), "--autograder", zero_zip,
                               "--time-limit", str(STOPPED_LIMIT), "--json"],
                              {**env, "TMPDIR": str(stopper_tmp), STOPPED_MARK: str(tmp)}, cwd=tmp)
        (tmp / "gradescope").mkdir()  # its working directory too: `python -c` puts it on sys.path
        clean = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # the venv must use its own course_lib
        clean["PYTHONPATH"] = env["PYTHONPATH"].split(os.pathsep)[0]  # the test guard only
        gradescope = self._popen([sys.executable, "-c", _gradescope_script(
            built[GRADESCOPE].autograder_zip, {"solution": built[GRADESCOPE].solution_notebook,
                                               "blank": built[GRADESCOPE].student_notebook},
            tmp / "gradescope")], clean, cwd=tmp / "gradescope")
        # A student who solved STUDENT_RUN: the solutions in the student folder (public tests only).
        student_dir = tmp / "student"
        shutil.copytree(built[STUDENT_RUN].release, student_dir)
        solved = student_dir / BY_NAME[STUDENT_RUN].source.name
        shutil.copy2(built[STUDENT_RUN].solution_notebook, solved)
        student = self._popen([sys.executable, "-c", EXECUTE, str(solved), str(tmp / "executed.ipynb")], env)

        # each waited for in a thread of its own: one that ends is reaped at once (a test that reads
        # this process's children would find it a zombie until then)
        procs = {"batch": batch, "cli": cli, "stopper": stopper, "gradescope": gradescope, "student": student,
                 "skipper": skipper}
        with ThreadPoolExecutor(len(procs)) as pool:
            out = dict(zip(procs, pool.map(self._wait, procs.values())))
        stdout, stderr = out["batch"]
        if not stdout.strip():
            raise RuntimeError(f"`course grade` of the batch printed no reports (exit {batch.returncode}):\n"
                               f"{stderr[-3000:]}")
        reports = [exercises.GradeReport.from_dict(d) for d in json.loads(stdout)]
        return {"reports": {j[0]: r for j, r in zip(jobs, reports)}, "guard_log": guard_log,
                "batch": (batch.returncode, stderr),
                "cli": (Path(cli_sub), cli.returncode, *out["cli"], tmp / "grades.csv", tmp / "feedback"),
                "stopped": (stopper.returncode, *out["stopper"], stopper_tmp, str(tmp)),
                "skipped": (skipper.returncode, *out["skipper"]),
                "gradescope": (gradescope.returncode, *out["gradescope"]),
                "student": (student.returncode, out["student"][1], tmp / "executed.ipynb")}
