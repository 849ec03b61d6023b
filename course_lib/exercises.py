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
:mod:`course_lib.grading`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from course_lib.utils import repo_root

BUILD_FORMAT = 1  # bump when the post-processing below changes, so every dist/ reads as stale
MANIFEST = "MANIFEST.json"
ZIP_NAME = "autograder.zip"
ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip entry can hold: no build time in dist/
CELL_TIMEOUT_ENV = "COURSE_GRADING_CELL_TIMEOUT"


# --------------------------------------------------------------------------------------------
# Finding exercises
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# The setup cell every exercise starts with (Colab: install the package, fetch the public tests)
# --------------------------------------------------------------------------------------------

def install_spec() -> str:
    """What pip installs on Colab: the course package with otter-grader, from the repository."""
    from course_lib import GITHUB_BRANCH, GITHUB_REPO

    return f"course-lib[grading] @ git+https://github.com/{GITHUB_REPO}@{GITHUB_BRANCH}"


def colab_setup_cell(name: str) -> str:
    """Source of an exercise's first code cell. otter needs its public tests as files next to
    the notebook; Colab opens the notebook alone, so the cell fetches them there."""
    return (
        "# Setup. On Google Colab: install the course package and fetch this exercise's public tests.\n"
        "# Anywhere else (JupyterHub, your laptop) the package and tests/ are already there.\n"
        "import os, sys\n"
        'if "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ:\n'
        f'    %pip install --quiet "{install_spec()}"\n'
        "    from course_lib.exercises import fetch_student_tests\n"
        f'    fetch_student_tests("{name}")\n'
        "import otter\n"
        f'grader = otter.Notebook("{name}.ipynb")'
    )


def fetch_student_tests(name: str, dest: str | os.PathLike = "tests", base_url: str | None = None) -> list[Path]:
    """Download the public tests of exercise ``name`` (its ``dist/student/tests/*.py``) into
    ``dest``, for ``grader.check`` on Colab. ``base_url`` defaults to the repository's raw files
    on GitHub; any URL urllib opens works (``file:///path/to/clone`` for a local copy)."""
    import urllib.request

    if base_url is None:
        from course_lib import GITHUB_BRANCH, GITHUB_REPO

        base_url = f"https://raw.githubusercontent.com/{GITHUB_REPO}/{GITHUB_BRANCH}"
    base = f"{base_url.rstrip('/')}/exercises/{name}/dist"
    try:
        with urllib.request.urlopen(f"{base}/{MANIFEST}", timeout=30) as r:
            manifest = json.loads(r.read().decode("utf-8"))
    except OSError as e:
        raise RuntimeError(f"could not fetch the tests of {name} from {base}: {e}") from e
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for rel in sorted(manifest["files"]):
        if rel.startswith("student/tests/") and rel.endswith(".py"):
            with urllib.request.urlopen(f"{base}/{rel}", timeout=30) as r:
                data = r.read()
            if hashlib.sha256(data).hexdigest() != manifest["files"][rel]:
                raise RuntimeError(f"{rel} of {name} does not match its manifest; try again later")
            target = dest / Path(rel).name
            target.write_bytes(data)
            written.append(target)
    return written


def colab_badge_line(name: str) -> str:
    """The "Open in Colab" badge that starts an exercise: it opens the student release."""
    from course_lib.smoke import colab_badge

    return colab_badge(f"exercises/{name}/dist/student/{name}.ipynb")


def _first(nb, cell_type: str):
    return next((c for c in nb.cells if c.cell_type == cell_type), None)


def setup_cell_problems(ex: Exercise) -> list[str]:
    """The first markdown cell of a source must start with the Colab badge and its first code
    cell must be :func:`colab_setup_cell`, both for the repository in course_lib.GITHUB_REPO."""
    import nbformat

    nb = nbformat.read(ex.source, as_version=4)
    problems = []
    fix = "run `course exercises sync` (it rewrites them from course_lib.GITHUB_REPO)"
    md, code = _first(nb, "markdown"), _first(nb, "code")
    if md is None or md.source.split("\n", 1)[0] != colab_badge_line(ex.name):
        problems.append(f"{ex.source}: the first markdown cell does not start with the Colab badge of {ex.name}; {fix}")
    if code is None or code.source != colab_setup_cell(ex.name):
        problems.append(f"{ex.source}: the first code cell is not the setup cell of {ex.name}; {fix}")
    return problems


def sync_setup_cell(ex: Exercise) -> bool:
    """Rewrite the badge line and the setup cell of ``ex``'s source; True if anything changed."""
    import nbformat

    nb = nbformat.read(ex.source, as_version=4)
    md, code = _first(nb, "markdown"), _first(nb, "code")
    if md is None or code is None:
        raise ValueError(f"{ex.source} needs a markdown cell (title) and a code cell (setup)")
    badge = colab_badge_line(ex.name)
    first, _, rest = md.source.partition("\n")
    new_md = md.source if first == badge else (
        badge + "\n" + rest if "colab.research.google.com" in first else badge + "\n\n" + md.source)
    if new_md == md.source and code.source == colab_setup_cell(ex.name):
        return False
    md.source, code.source = new_md, colab_setup_cell(ex.name)
    ex.source.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    return True


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def otter_version() -> str:
    from importlib.metadata import version

    return version("otter-grader")


def source_problems(ex: Exercise) -> list[str]:
    """What is wrong with an instructor source before we even run otter (outputs committed...)."""
    import nbformat

    nb = nbformat.read(ex.source, as_version=4)
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count")):
            problems.append(f"{ex.source}: cell {i} has outputs; clear them before committing "
                            "(Jupyter: Edit > Clear Outputs of All Cells)")
    return problems


def _normalise_notebook(path: Path, name: str) -> None:
    """Replace otter's random cell ids with ids derived from the cell's place and content."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        digest = hashlib.sha1(f"{name}/{i}/{cell.cell_type}/{cell.source}".encode()).hexdigest()
        cell["id"] = digest[:12]
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")


def _normalise_zip(src: Path, dest: Path) -> None:
    """Rewrite otter's time-stamped zip with sorted entries and a fixed date."""
    with zipfile.ZipFile(src) as zin:
        entries = sorted((info.filename, zin.read(info)) for info in zin.infolist() if not info.is_dir())
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED) as zout:
        for filename, data in entries:
            info = zipfile.ZipInfo(filename, date_time=ZIP_DATE)
            mode = 0o755 if filename == "run_autograder" else 0o644
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(info, data)


def _manifest(ex: Exercise, dist: Path) -> dict:
    files = {p.relative_to(dist).as_posix(): sha256(p)
             for p in sorted(dist.rglob("*")) if p.is_file() and p.name != MANIFEST}
    return {
        "exercise": ex.name,
        "source": ex.source.name,
        "source_sha256": sha256(ex.source),
        "otter_grader": otter_version(),
        "build_format": BUILD_FORMAT,
        "files": files,
    }


@contextlib.contextmanager
def _quiet(enabled: bool = True):
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


def build(ex: Exercise, run_tests: bool = False, quiet: bool = True) -> Path:
    """Run ``otter assign`` on ``ex`` and replace ``ex.dist`` with its normalised output.

    ``run_tests`` makes otter run the tests against the solution notebook while building (slow;
    ``course exercises build --verify`` and tests/test_exercises.py grade the releases instead).
    """
    from otter.assign import main as otter_assign

    problems = source_problems(ex) + setup_cell_problems(ex)
    if problems:
        raise ValueError("\n".join(problems))
    with tempfile.TemporaryDirectory(prefix=f"course_assign_{ex.name}_") as tmp:
        work = Path(tmp) / ex.name
        work.mkdir()
        shutil.copy2(ex.source, work / ex.source.name)
        out = work / "dist"
        with _quiet(quiet):
            otter_assign(str(work / ex.source.name), str(out), no_pdfs=True, no_run_tests=not run_tests)
        zips = sorted((out / "autograder").glob("*.zip"))
        if len(zips) != 1:
            raise RuntimeError(f"otter assign wrote {len(zips)} autograder zips for {ex.name}, expected 1")
        _normalise_zip(zips[0], out / "autograder" / ZIP_NAME)
        zips[0].unlink()
        for nb_path in out.rglob("*.ipynb"):
            _normalise_notebook(nb_path, ex.name)
        manifest = _manifest(ex, out)
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        # Swap in the new dist/ only once it is complete: a failed build leaves the old one.
        staged = ex.dir / ".dist.new"
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(out, staged)
    shutil.rmtree(ex.dist, ignore_errors=True)
    staged.rename(ex.dist)
    return ex.dist


def check(ex: Exercise) -> list[str]:
    """Reasons ``ex.dist`` does not match its source (empty list: up to date)."""
    manifest_path = ex.dist / MANIFEST
    if not manifest_path.is_file():
        return [f"{ex.name}: no {manifest_path.relative_to(ex.dir)}; run `course exercises build {ex.name}`"]
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    problems = []
    rebuild = f"run `course exercises build {ex.name}` (or make exercises)"
    if manifest.get("source_sha256") != sha256(ex.source):
        problems.append(f"{ex.name}: {ex.source.name} changed since dist/ was built; {rebuild}")
    if manifest.get("build_format") != BUILD_FORMAT:
        problems.append(f"{ex.name}: dist/ was built by an older course_lib.exercises; {rebuild}")
    if manifest.get("otter_grader") != otter_version():
        problems.append(f"{ex.name}: dist/ was built with otter-grader {manifest.get('otter_grader')}, "
                        f"this is {otter_version()}; {rebuild}")
    present = {p.relative_to(ex.dist).as_posix(): p for p in ex.dist.rglob("*")
               if p.is_file() and p.name != MANIFEST}
    for rel, digest in manifest.get("files", {}).items():
        if rel not in present:
            problems.append(f"{ex.name}: dist/{rel} is missing; {rebuild}")
        elif sha256(present[rel]) != digest:
            problems.append(f"{ex.name}: dist/{rel} differs from what the build wrote (edited by "
                            f"hand?); generated files are never edited: {rebuild}")
    for rel in sorted(set(present) - set(manifest.get("files", {}))):
        problems.append(f"{ex.name}: dist/{rel} was not written by the build; remove it or {rebuild}")
    return problems


# --------------------------------------------------------------------------------------------
# Grading
# --------------------------------------------------------------------------------------------

class CellTimeLimit:
    """otter plugin: every cell of a submission gets at most ``cell_timeout`` seconds.

    Inserted as the first and last cells of the submission before otter adds its own: the first
    arms SIGALRM before each cell runs and raises ``TimeoutError`` in the kernel when it fires, the
    last disarms it so otter's own test-running cell is not cut short. The tests themselves bound
    multi-rank work through :mod:`course_lib.grading`. Configure in an exercise's assignment
    config (``generate: plugins: - course_lib.exercises.CellTimeLimit: {cell_timeout: 120}``);
    the environment variable ``COURSE_GRADING_CELL_TIMEOUT`` overrides it.
    """

    ARM = '''\
# course_lib.exercises.CellTimeLimit: no cell may run longer than {seconds} s during grading
import signal as _course_signal

def _course_cell_timeout(signum, frame):
    raise TimeoutError("this cell ran longer than {seconds} s during grading and was stopped "
                       "(an endless loop, or a process that never finished?)")

def _course_arm(*args):
    _course_signal.alarm({seconds})

def _course_disarm(*args):
    _course_signal.alarm(0)

if hasattr(_course_signal, "SIGALRM"):  # POSIX; elsewhere cells are not bounded
    _course_signal.signal(_course_signal.SIGALRM, _course_cell_timeout)
    get_ipython().events.register("pre_run_cell", _course_arm)
    get_ipython().events.register("post_run_cell", _course_disarm)
'''
    DISARM = '''\
# course_lib.exercises.CellTimeLimit: grading cells from here on are bounded by their own timeouts
if hasattr(_course_signal, "SIGALRM"):
    _course_signal.alarm(0)
    get_ipython().events.unregister("pre_run_cell", _course_arm)
    get_ipython().events.unregister("post_run_cell", _course_disarm)
'''

    def __init__(self, submission_path, submission_metadata, plugin_config):
        self.submission_path = submission_path
        self.plugin_config = plugin_config or {}

    def seconds(self) -> int:
        value = os.environ.get(CELL_TIMEOUT_ENV) or self.plugin_config.get("cell_timeout", 120)
        return max(1, int(float(value)))

    def before_execution(self, submission):
        import nbformat

        if isinstance(submission, str):  # a .py submission: nothing to bound per cell
            return submission
        submission.cells.insert(0, nbformat.v4.new_code_cell(self.ARM.format(seconds=self.seconds())))
        submission.cells.append(nbformat.v4.new_code_cell(self.DISARM))
        return submission

    # otter calls only the events a plugin has (hasattr), so the others are simply absent.


@dataclass
class QuestionScore:
    name: str
    score: float
    possible: float
    failures: list[str] = field(default_factory=list)  # messages of failed test cases


@dataclass
class GradeReport:
    submission: str
    autograder: str
    questions: list[QuestionScore]
    error: str | None = None  # grading itself failed (the submission still scores what it got)
    cell_errors: list[str] = field(default_factory=list)  # errors raised by submission cells
    seconds: float = 0.0

    @property
    def total(self) -> float:
        return sum(q.score for q in self.questions)

    @property
    def possible(self) -> float:
        return sum(q.possible for q in self.questions)

    def score(self, question: str) -> float:
        return next(q.score for q in self.questions if q.name == question)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "possible": self.possible}

    def format(self, verbose: bool = True) -> str:
        width = max([len(q.name) for q in self.questions] + [8])
        lines = [f"{self.submission}  (autograder: {self.autograder})"]
        if verbose:
            lines += [f"  cell error: {msg}" for msg in self.cell_errors]
        for q in self.questions:
            lines.append(f"  {q.name:<{width}}  {_num(q.score):>5} / {_num(q.possible)}")
            if verbose:
                for msg in q.failures:
                    lines += ["      " + line for line in msg.strip().splitlines()[-6:]]
        if self.error:
            lines.append(f"ERROR: grading did not complete: {self.error}")
        lines.append(f"TOTAL: {_num(self.total)} / {_num(self.possible)}")
        return "\n".join(lines)


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def questions_in(autograder_zip: Path) -> dict[str, float]:
    """Question name -> points, read from the tests in the autograder zip (hidden ones included)."""
    from otter.test_files import ExceptionTestFile

    points = {}
    with zipfile.ZipFile(autograder_zip) as zf:
        for name in sorted(zf.namelist()):
            if name.startswith("tests/") and name.endswith(".py"):
                tf = ExceptionTestFile.from_string(zf.read(name).decode("utf-8"), path=name)
                points[tf.name] = tf.possible
    return points


def assignment_name(submission: Path) -> str | None:
    import nbformat

    nb = nbformat.read(submission, as_version=4)
    return nb.metadata.get("otter", {}).get("assignment_name")


def find_autograder(submission: Path, root: Path | None = None) -> Path:
    """The autograder zip for a submission, from the assignment name otter stores in its metadata."""
    name = assignment_name(submission)
    if not name:
        raise ValueError(f"{submission} carries no otter assignment name in its metadata; is it an "
                         "exercise notebook from exercises/*/dist/student/? Pass --autograder ZIP")
    ex = select([name], root)[0]
    if not ex.autograder_zip.is_file():
        raise FileNotFoundError(f"{ex.autograder_zip} not found; run `course exercises build {name}`")
    return ex.autograder_zip


def grade(submission: str | os.PathLike, autograder: str | os.PathLike | None = None,
          root: Path | None = None, quiet: bool = True) -> GradeReport:
    """Grade one notebook locally with otter (no Docker, no network)."""
    import time

    submission = Path(submission).resolve()
    if not submission.is_file():
        raise FileNotFoundError(f"submission {submission} does not exist")
    if submission.suffix != ".ipynb":
        raise ValueError(f"submission must be a .ipynb notebook, got {submission.name}")
    autograder = Path(autograder).resolve() if autograder else find_autograder(submission, root)
    if not autograder.is_file():
        raise FileNotFoundError(f"autograder zip {autograder} does not exist")
    possible = questions_in(autograder)

    t0 = time.perf_counter()
    error, results = None, None
    try:
        from otter.api import grade_submission

        with _quiet(quiet):
            results = grade_submission(str(submission), str(autograder), quiet=quiet)
        if results.catastrophic_error is not None:
            error = repr(results.catastrophic_error)
    except Exception as e:  # the grader can fail on a broken submission: it then scores zero
        error = f"{type(e).__name__}: {e}"
    questions = []
    for name, pts in possible.items():
        tf = results.results.get(name) if results is not None and error is None else None
        if tf is None:
            questions.append(QuestionScore(name, 0.0, pts, [] if error else ["not graded"]))
            continue
        failures = [f"{r.test_case.name}{' (hidden)' if r.test_case.hidden else ''}: "
                    + r.message.replace("❌ Test case failed", "").strip()
                    for r in tf.test_case_results if not r.passed]
        questions.append(QuestionScore(name, float(tf.score), float(tf.possible), failures))
    cell_errors = _cell_errors(results.notebook) if results is not None and results.notebook else []
    return GradeReport(str(submission), str(autograder), questions, error, cell_errors,
                       time.perf_counter() - t0)


def _cell_errors(executed_nb) -> list[str]:
    """'[first line of the cell] Name: message' for every cell of the executed submission that
    raised (grading goes on after an error, so these explain a lost point)."""
    errors = []
    for cell in executed_nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "error":
                first = next((ln for ln in cell.source.splitlines() if ln.strip()), "")[:60]
                errors.append(f"[{first}] {out.get('ename')}: {str(out.get('evalue', ''))[:300]}")
    return errors


def _grade_job(job: tuple) -> dict:
    submission, autograder, root = job
    try:
        return grade(submission, autograder, root).to_dict()
    except Exception as e:
        return {"submission": str(submission), "autograder": str(autograder), "questions": [],
                "error": f"{type(e).__name__}: {e}", "seconds": 0.0}


def _report_from_dict(d: dict) -> GradeReport:
    return GradeReport(d["submission"], d["autograder"], [QuestionScore(**q) for q in d["questions"]],
                       d.get("error"), d.get("cell_errors", []), d.get("seconds", 0.0))


def grade_many(submissions: list, autograders: list | None = None, root: Path | None = None,
               jobs: int = 1) -> list[GradeReport]:
    """Grade several notebooks, ``jobs`` at a time (each worker process grades many in turn)."""
    autograders = list(autograders) if autograders is not None else [None] * len(submissions)
    if len(autograders) != len(submissions):
        raise ValueError("give one autograder per submission (or none)")
    work = [(str(s), str(a) if a else None, str(root) if root else None)
            for s, a in zip(submissions, autograders)]
    if jobs <= 1 or len(work) <= 1:
        return [_report_from_dict(_grade_job(w)) for w in work]
    import multiprocessing as mp

    # spawn: a clean process (no inherited threads or sockets); otter is imported once per worker
    with mp.get_context("spawn").Pool(min(jobs, len(work))) as pool:
        return [_report_from_dict(d) for d in pool.map(_grade_job, work, chunksize=1)]


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="course exercises",
                                description="Build the graded exercises with otter-grader.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="run otter assign: dist/student and dist/autograder")
    b.add_argument("names", nargs="*", help="exercises to build (NN or NN_topic; default: all)")
    b.add_argument("--root", type=Path, help="exercises folder (default: exercises/ of this clone)")
    b.add_argument("--verify", action="store_true",
                   help="then grade each solution (must score full marks) and blank release (zero)")
    b.add_argument("--jobs", type=int, default=2, help="gradings at once for --verify (default 2)")
    b.add_argument("-v", "--verbose", action="store_true", help="show otter's output")
    c = sub.add_parser("check", help="fail if a dist/ is stale or was edited by hand")
    c.add_argument("names", nargs="*")
    c.add_argument("--root", type=Path)
    ls = sub.add_parser("list", help="list the exercises")
    ls.add_argument("--root", type=Path)
    sy = sub.add_parser("sync", help="rewrite each source's setup cell from course_lib.GITHUB_REPO")
    sy.add_argument("names", nargs="*")
    sy.add_argument("--root", type=Path)
    args = p.parse_args(argv)

    try:
        exercises = select(getattr(args, "names", []), args.root)
    except (ValueError, FileNotFoundError) as e:
        print(f"course exercises: {e}", file=sys.stderr)
        return 2
    if args.cmd == "list":
        for ex in exercises:
            state = "up to date" if not check(ex) else "needs build"
            print(f"{ex.name:<24} {state}")
        return 0
    if args.cmd == "sync":
        for ex in exercises:
            if sync_setup_cell(ex):
                print(f"rewrote the setup cell of {ex.source}; now run `course exercises build {ex.name}`")
        return 0
    if args.cmd == "check":
        stale = {ex.name: check(ex) + setup_cell_problems(ex) for ex in exercises}
        problems = [msg for msgs in stale.values() for msg in msgs]
        for msg in problems:
            print(msg, file=sys.stderr)
        print(f"{sum(not m for m in stale.values())}/{len(exercises)} exercises up to date")
        return 1 if problems else 0

    from tqdm import tqdm

    for ex in tqdm(exercises, desc="otter assign", unit="exercise", disable=len(exercises) < 2):
        try:
            build(ex, quiet=not args.verbose)
        except Exception as e:
            print(f"course exercises: building {ex.name} failed: {e}", file=sys.stderr)
            return 1
        tqdm.write(f"built {ex.dist}")
    if not args.verify:
        return 0
    subs = [ex.solution_notebook for ex in exercises] + [ex.student_notebook for ex in exercises]
    zips = [ex.autograder_zip for ex in exercises] * 2
    reports = grade_many(subs, zips, jobs=args.jobs)
    bad = 0
    for i, r in enumerate(reports):
        want_full = i < len(exercises)
        ok = (r.total == r.possible > 0) if want_full else r.total == 0
        bad += not ok
        kind = "solution" if want_full else "blank release"
        print(f"{'ok ' if ok else 'BAD'} {kind:<13} {Path(r.submission).name:<28} "
              f"{_num(r.total)} / {_num(r.possible)}  ({r.seconds:.1f} s)")
    return 1 if bad else 0


def grade_cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="course grade",
        description="Grade exercise notebooks locally (otter, no Docker, no network): the score of "
                    "each question, then TOTAL: x / y.")
    p.add_argument("submissions", nargs="+", type=Path, help="submitted .ipynb notebooks")
    p.add_argument("--autograder", type=Path,
                   help="autograder zip (default: found from the notebook's assignment name in "
                        "exercises/NN_topic/dist/autograder/)")
    p.add_argument("--root", type=Path, help="exercises folder (default: exercises/ of this clone)")
    p.add_argument("--jobs", type=int, default=1, help="notebooks graded at once")
    p.add_argument("--cell-timeout", type=float,
                   help=f"seconds any cell may run (default from the exercise; env {CELL_TIMEOUT_ENV})")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no failure messages, scores only")
    args = p.parse_args(argv)

    for s in args.submissions:
        if not s.is_file():
            print(f"course grade: {s} does not exist", file=sys.stderr)
            return 2
    if args.autograder is not None and not args.autograder.is_file():
        print(f"course grade: autograder zip {args.autograder} does not exist", file=sys.stderr)
        return 2
    if args.cell_timeout is not None:
        if args.cell_timeout <= 0:
            print("course grade: --cell-timeout must be > 0 seconds", file=sys.stderr)
            return 2
        os.environ[CELL_TIMEOUT_ENV] = str(args.cell_timeout)
    try:
        zips = [args.autograder or find_autograder(s, args.root) for s in args.submissions]
    except (ValueError, FileNotFoundError) as e:
        print(f"course grade: {e}", file=sys.stderr)
        return 2
    reports = grade_many(args.submissions, zips, args.root, jobs=args.jobs)
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        print("\n\n".join(r.format(verbose=not args.quiet) for r in reports))
    return 1 if any(r.error for r in reports) else 0


if __name__ == "__main__":
    sys.exit(cli())
