"""``course grade``: otter's local grading (``otter run``, no Docker) in this Python, with a
per-cell time limit, a score per question and the failure messages of each test case."""

from __future__ import annotations

import os
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from course_lib.exercises.layout import quiet as silenced
from course_lib.exercises.layout import select

CELL_TIMEOUT_ENV = "COURSE_GRADING_CELL_TIMEOUT"


class CellTimeLimit:
    """otter plugin: every cell of a submission gets at most ``cell_timeout`` seconds.

    Inserted as the first and last cells of the submission before otter adds its own: the first
    arms SIGALRM before each cell runs and raises ``TimeoutError`` in the kernel when it fires, the
    last disarms it so otter's own test-running cell is not cut short. The tests themselves bound
    multi-rank work through :mod:`course_lib.exercises.grading`. Configure in an exercise's assignment
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
            lines.append(f"  {q.name:<{width}}  {points_text(q.score):>5} / {points_text(q.possible)}")
            if verbose:
                for msg in q.failures:
                    lines += ["      " + line for line in msg.strip().splitlines()[-6:]]
        if self.error:
            lines.append(f"ERROR: grading did not complete: {self.error}")
        lines.append(f"TOTAL: {points_text(self.total)} / {points_text(self.possible)}")
        return "\n".join(lines)


def points_text(x: float) -> str:
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

        with silenced(quiet):
            results = grade_submission(str(submission), str(autograder), quiet=quiet)
        if results.catastrophic_error is not None:
            error = repr(results.catastrophic_error)
    except Exception as e:  # noqa: BLE001 - a broken submission can make otter fail: it scores zero
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
    except Exception as e:  # noqa: BLE001 - one bad submission must not stop the others
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
