"""python -m course_lib.exercises.grade SUBMISSION.ipynb AUTOGRADER.zip REPORT.json SEED   (one worker; course grade runs it)

``course grade``: otter's local grading (``otter run``, no Docker), one killable process per
submission, a score per question and the failure messages of each test case.

Limits, all enforced from outside the student's code:

- every check of an answer runs in a child process (``grading.isolated``) or on ranks
  (``grading.run_ranks``), both started clean by :mod:`course_lib.launch.ranks`, that the test's process kills after ``COURSE_GRADING_TIMEOUT`` seconds
  (``course grade`` sets 10 unless the environment says otherwise): an endless loop or a
  deadlock costs its question, about 10-25 s;
- every cell of the submission gets ``cell_timeout`` seconds (:class:`CellTimeLimit`);
- the whole submission is graded in a process of its own (this module's ``__main__``) that
  :func:`grade_many` kills, with its kernel and ranks, after ``time_limit`` seconds: whatever
  happens, ``course grade`` returns and a batch never stalls. A cell that ran past it (one that
  blocks in C code, where the cell limit's signal cannot stop it) is then replaced by a cell that
  raises, and the submission is graded once more: that cell costs the questions that need it, not
  all of them. A second stop scores zero.
Hidden tests draw their inputs from a seed per submission (:mod:`.draws`), kept in the report.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

from course_lib.exercises.cell_limit import (  # noqa: F401 - CellTimeLimit re-exported
    CELL_LOG_ENV, CELL_TIMEOUT_ENV, CellTimeLimit, check_cell_timeout, running_cell, running_cell_log)
from course_lib.exercises.draws import seeded, submission_seed
from course_lib.exercises.layout import quiet as silenced
from course_lib.exercises.layout import select
from course_lib.launch.procs import descendants, kill_quietly
from course_lib.launch.ranks import socket_needs_tmp
from course_lib.utils import progress_bar

GRADING_TIMEOUT_S = 10.0  # seconds per checked call while grading (COURSE_GRADING_TIMEOUT)
SUBMISSION_LIMIT_S = 600.0  # wall clock for one submission, kernel and ranks included
KERNEL_STARTS = 3  # kernels started for one submission before grading gives up on the machine
HIDDEN_FAILED = "a hidden test failed"


@dataclass
class QuestionScore:
    name: str
    score: float
    possible: float
    failures: list[str] = field(default_factory=list)  # messages of failed test cases (instructor)
    public: list[str] = field(default_factory=list)  # what a student may read about the failures


@dataclass
class GradeReport:
    submission: str
    autograder: str
    questions: list[QuestionScore]
    error: str | None = None  # grading itself failed (the submission still scores what it got)
    cell_errors: list[str] = field(default_factory=list)  # errors raised by submission cells
    seconds: float = 0.0
    seed: int | None = None  # the seed the hidden tests drew their inputs from

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

    @classmethod
    def from_dict(cls, d: dict) -> GradeReport:
        """The report that :meth:`to_dict` wrote (a worker's file, ``course grade --json``)."""
        return cls(d["submission"], d["autograder"], [QuestionScore(**q) for q in d["questions"]],
                   d.get("error"), d.get("cell_errors", []), d.get("seconds", 0.0), d.get("seed"))

    @property
    def student(self) -> str:
        """Who handed it in, as far as we know: the file's name without .ipynb."""
        return Path(self.submission).stem

    def format(self, verbose: bool = True, student_safe: bool = False) -> str:
        """The report: scores, then per question the failure messages (``student_safe``: public
        tests' messages only, a hidden test's failure as one line without its source)."""
        width = max([len(q.name) for q in self.questions] + [8])
        head = self.submission if not student_safe else Path(self.submission).name
        seed = f", seed {self.seed}" if self.seed is not None else ""
        lines = [f"{head}  (autograder: {self.autograder}{seed})" if not student_safe else head]
        if verbose:
            lines += [f"  cell error: {msg}" for msg in self.cell_errors]
        for q in self.questions:
            lines.append(f"  {q.name:<{width}}  {points_text(q.score):>5} / {points_text(q.possible)}")
            if verbose:
                for msg in (q.public if student_safe else q.failures):
                    lines += ["      " + line for line in brief(msg)]
        if self.error:
            lines.append(f"ERROR: grading did not complete: {self.error}")
        lines.append(f"TOTAL: {points_text(self.total)} / {points_text(self.possible)}")
        return "\n".join(lines)


def points_text(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def questions_in(autograder_zip: Path) -> dict[str, float]:
    """Question name -> points, read from the tests in the autograder zip (hidden ones included)."""
    # otter-grader is the optional `grading` extra: imported only where it grades or assigns
    from otter.test_files import ExceptionTestFile

    points = {}
    with zipfile.ZipFile(autograder_zip) as zf:
        for name in sorted(zf.namelist()):
            if name.startswith("tests/") and name.endswith(".py"):
                tf = ExceptionTestFile.from_string(zf.read(name).decode("utf-8"), path=name)
                points[tf.name] = tf.possible
    return points


def assignment_name(submission: Path) -> str | None:
    # nbformat (0.15 s) only where a notebook is read: importing course_lib.exercises stays light
    import nbformat

    try:
        nb = nbformat.read(submission, as_version=4)
    except Exception as e:  # noqa: BLE001 - not JSON, not UTF-8, no cells (jsonschema's ValidationError): name the file
        said = (str(e).strip().splitlines() or [""])[0]  # one line: a batch's error names the file first
        raise ValueError(f"{submission} is not a notebook that can be read ({type(e).__name__}: {said}); "
                         "fix or remove it, or pass --autograder ZIP to grade it as it is (it scores zero)") from None
    otter = nb.metadata.get("otter", {})
    return otter.get("assignment_name") if isinstance(otter, dict) else None  # a student's metadata may be anything


def find_autograder(submission: Path, root: Path | None = None) -> Path:
    """The autograder zip for a submission, from the assignment name otter stores in its metadata."""
    name = assignment_name(submission)
    if not name:
        raise ValueError(f"{submission} carries no otter assignment name in its metadata; is it an "
                         "exercise notebook from exercises/NN_topic/? Pass --autograder ZIP")
    ex = select([name], root)[0]
    if not ex.autograder_zip.is_file():
        raise FileNotFoundError(f"{ex.autograder_zip} not found; run `course exercises build {name}`")
    return ex.autograder_zip


def grade(submission: str | os.PathLike, autograder: str | os.PathLike | None = None,
          root: Path | None = None, quiet: bool = True, seed: int | None = None) -> GradeReport:
    """Grade one notebook locally with otter (no Docker, no network). The hidden tests draw
    their inputs from ``seed`` (default: :func:`~course_lib.exercises.draws.submission_seed`)."""
    submission = Path(submission).resolve()
    if not submission.is_file():
        raise FileNotFoundError(f"submission {submission} does not exist")
    if submission.suffix != ".ipynb":
        raise ValueError(f"submission must be a .ipynb notebook, got {submission.name}")
    autograder = Path(autograder).resolve() if autograder else find_autograder(submission, root)
    if not autograder.is_file():
        raise FileNotFoundError(f"autograder zip {autograder} does not exist")
    possible = questions_in(autograder)
    assignment = assignment_of_zip(autograder)
    seed = submission_seed(submission) if seed is None else int(seed)

    t0 = time.perf_counter()
    error, results = None, None
    with tempfile.TemporaryDirectory(prefix="course_grade_") as tmp:
        # Under the name the notebook itself uses (NotebookGrader("NN_topic.ipynb")), whatever
        # the student called the file.
        canonical = Path(tmp) / f"{assignment or submission.stem}.ipynb"
        shutil.copy2(submission, canonical)
        try:
            # otter-grader is the optional `grading` extra: imported only where it grades or assigns,
            # and nbclient (0.4 s) with it
            from otter.api import grade_submission

            from course_lib.exercises.runner import every_client_polls_in_slices

            # the kernel otter starts inherits the seed; otter's client waits without a timeout, so a
            # lost wake-up (exercises.runner) would cost the submission its grade at the time limit;
            # a kernel that never answers is the machine's fault, not the student's: another one
            with silenced(quiet), seeded(seed), every_client_polls_in_slices(kernel_starts=KERNEL_STARTS):
                results = grade_submission(str(canonical), str(autograder), quiet=quiet)
            if results.catastrophic_error is not None:
                error = repr(results.catastrophic_error)
        except Exception as e:  # noqa: BLE001 - a broken submission can make otter fail: it scores zero
            error = f"{type(e).__name__}: {e}"
        if error and (cell := running_cell()):  # e.g. a cell that killed the kernel: say which
            error += f" (while running the cell that starts with: {cell})"
    questions = []
    for name, pts in possible.items():
        tf = results.results.get(name) if results is not None and error is None else None
        if tf is None:
            questions.append(QuestionScore(name, 0.0, pts, [] if error else ["not graded"],
                                           [] if error else ["not graded"]))
            continue
        failed = [r for r in tf.test_case_results if not r.passed]
        failures = [f"{r.test_case.name}{' (hidden)' if r.test_case.hidden else ''}: "
                    + r.message.replace("❌ Test case failed", "").strip() for r in failed]
        public = [HIDDEN_FAILED if r.test_case.hidden else f"{r.test_case.name}: {_last_error(r.message)}"
                  for r in failed]
        questions.append(QuestionScore(name, float(tf.score), float(tf.possible), failures, public))
    cell_errors = _cell_errors(results.notebook) if results is not None and results.notebook else []
    return GradeReport(str(submission), str(autograder), questions, error, cell_errors,
                       time.perf_counter() - t0, seed)


def assignment_of_zip(autograder_zip: Path) -> str | None:
    with zipfile.ZipFile(autograder_zip) as zf:
        if "otter_config.json" not in zf.namelist():
            return None
        return json.loads(zf.read("otter_config.json")).get("assignment_name")


# An exception's own line ("RanksTimeoutError: the 2 ranks ..."), not otter's "Error at line 25 in test ..."
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning): ")


def _last_error(message: str) -> str:
    """The exception line of a test's traceback (and what follows it), without the source lines."""
    lines = [ln for ln in message.replace("❌ Test case failed", "").strip().splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        if EXCEPTION_LINE.match(line):
            return "\n".join(lines[i:])
    return lines[-1] if lines else "failed"


def brief(message: str, tail: int = 4) -> list[str]:
    """A failure message in a few lines: its first (the test's name), the exception's own line
    (the course's diagnosis, e.g. which ranks never joined) and the last ``tail`` lines; a long
    traceback's middle becomes "...". The whole message stays in the JSON report."""
    lines = [ln for ln in message.strip().splitlines() if set(ln.strip()) - set("^~")]  # no caret lines
    if len(lines) <= 2 + tail:
        return lines
    first = next((i for i, ln in enumerate(lines) if i and EXCEPTION_LINE.match(ln)), 0)
    start = max(len(lines) - tail, first + 1)
    return [lines[0]] + ([lines[first]] if first else []) + (["..."] if start > first + 1 else []) + lines[start:]


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


def _stopped_report(submission: str, autograder: str, why: str, seconds: float, seed=None) -> GradeReport:
    """Every question zero, with the reason: what a killed or crashed grading worker leaves."""
    questions = [QuestionScore(n, 0.0, p, [why], [why]) for n, p in questions_in(Path(autograder)).items()]
    return GradeReport(submission, autograder, questions, why, [], seconds, seed)


class _Workers:
    """The grading workers running now. Each is a session of its own (so the terminal's Ctrl-C
    does not reach it): :meth:`stop` kills them all, and any started after it, when the grader
    stops (Ctrl-C, an error), instead of leaving them to run to their time limit as orphans."""

    def __init__(self):
        self.lock, self.running, self.stopped = threading.Lock(), set(), False

    def started(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.running.add(proc)
            if self.stopped:
                _kill_session(proc)

    def finished(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.running.discard(proc)

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            for proc in self.running:
                _kill_session(proc)


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill a grading worker and every process under it. Its session holds the worker, but not
    its kernel: jupyter_client starts a kernel in a session of its own. An orphaned kernel exits
    by itself (ipykernel watches its parent from a thread), unless a cell blocks in C code holding
    the GIL: then that thread never runs, and the kernel would run on, at full CPU for a busy loop."""
    family = descendants(proc.pid)  # the kernel, and the ranks it started: before the kill, then init owns them
    try:
        # the group too: it holds what the walk cannot find, a process of the worker's whose parent died
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    kill_quietly(family)


def _worker_argv(submission: str, autograder: str, report: Path, seed: int) -> list[str]:
    """The command of one grading worker (this module's ``__main__``), which writes ``report``."""
    return [sys.executable, "-m", "course_lib.exercises.grade", submission, autograder, str(report), str(seed)]


SKIPPED_CELL = """# {first}
raise TimeoutError("grading skipped this cell: it ran past the submission's limit of {limit:g} s, where "
                   "its own time limit could not stop it (blocked in C code?), so the notebook was "
                   "graded again without it")
"""


def _skip_cell(submission: str, source: str, limit: float, folder: Path) -> Path | None:
    """A copy of ``submission`` in ``folder`` (same name) whose code cells with exactly ``source``
    raise :data:`SKIPPED_CELL` instead; None when no cell has that source."""
    # nbformat (0.15 s) only where a notebook is rewritten: importing course_lib.exercises stays light
    import nbformat

    nb = nbformat.read(submission, as_version=4)
    hits = [c for c in nb.cells if c.cell_type == "code" and c.source == source]
    if not source.strip() or not hits:
        return None
    first = next(line for line in source.splitlines() if line.strip())
    for cell in hits:
        cell.source, cell.outputs = SKIPPED_CELL.format(first=first[:120], limit=limit), []
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / Path(submission).name)
    return folder / Path(submission).name


def _grade_in_process(submission: str, autograder: str, time_limit: float, env: dict,
                      seed: int | None = None, workers: _Workers | None = None) -> GradeReport:
    """Grade one submission in a worker process of its own session; kill the whole session
    (worker, kernel, ranks) at ``time_limit``. Where a cell of the submission was running then,
    grade it once more without that cell (:data:`SKIPPED_CELL`), within ``time_limit`` again;
    the report keeps the submission's own path, and its seconds are both gradings'."""
    seed = submission_seed(submission) if seed is None else seed
    report, source = _grade_once(submission, autograder, time_limit, env, seed, workers)
    if report.error is None or not source:
        return report
    with tempfile.TemporaryDirectory(prefix="course_grade_skip_") as tmp:
        if (skipped := _skip_cell(submission, source, time_limit, Path(tmp))) is None:
            return report
        again, _ = _grade_once(str(skipped), autograder, time_limit, env, seed, workers)
    if again.error is not None:  # stopped again, or failed: the first grading's reason stands
        return report
    again.submission, again.seconds = submission, report.seconds + again.seconds
    return again


def _job_parent() -> str | None:
    """The folder for a worker's job folder: the grader's temporary folder (None), unless the
    worker's fork-server socket would not fit an AF_UNIX path under it; then /tmp. The ranks would
    still start (``launch.ranks`` then makes multiprocessing's folder in /tmp), but that folder
    would outlive a worker killed at the time limit: in the job folder, it is removed with it."""
    worker_tmp = os.path.join(tempfile.gettempdir(), "course_grade_job_XXXXXXXX", "tmp")
    return "/tmp" if socket_needs_tmp(worker_tmp) else None


def _grade_once(submission: str, autograder: str, time_limit: float, env: dict, seed: int,
                workers: _Workers | None = None) -> tuple[GradeReport, str]:
    """One grading worker, killed at ``time_limit``: its report, and the source of the submission's
    cell that was running when the limit stopped it ("" otherwise). The session's temporary files
    (the copy of the submission, multiprocessing's sockets) go in this job's folder, removed here:
    a killed worker leaves nothing in the grader's temporary folder."""
    workers = workers or _Workers()
    with tempfile.TemporaryDirectory(prefix="course_grade_job_", dir=_job_parent()) as tmp:
        out = Path(tmp) / "report.json"
        log = Path(tmp) / "worker.log"
        worker_tmp = Path(tmp) / "tmp"
        worker_tmp.mkdir()
        t0 = time.monotonic()
        with open(log, "wb") as log_file:
            env = {**env, "TMPDIR": str(worker_tmp), CELL_LOG_ENV: str(Path(tmp) / "running_cell.txt")}
            proc = subprocess.Popen(_worker_argv(submission, autograder, out, seed), stdout=log_file,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            workers.started(proc)
            try:
                proc.wait(timeout=time_limit)
            except subprocess.TimeoutExpired:
                pass
            finally:
                _kill_session(proc)
                proc.wait()
                workers.finished(proc)
        seconds = time.monotonic() - t0
        if out.is_file():
            return GradeReport.from_dict(json.loads(out.read_text(encoding="utf-8"))), ""
        cell, source = running_cell_log(env)
        if seconds >= time_limit:
            why = (f"grading was stopped after the submission's limit of {time_limit:g} s (a cell "
                   "that never ends and ignored its own time limit?"
                   + (f" The cell running then starts with: {cell}" if cell else "") + "); every question scores zero")
            return _stopped_report(submission, autograder, why, seconds, seed), source
        said = log.read_text(errors="replace").strip().splitlines()[-3:]
        why = f"the grading process failed (exit code {proc.returncode}): {' / '.join(said)}"
        return _stopped_report(submission, autograder, why, seconds, seed), ""


def grading_env(base: dict | None = None, cell_timeout: float | str | None = None) -> dict:
    """The environment of a grading worker: a copy of ``base`` (default ``os.environ``), where the
    grading timeout defaults to 10 s per call and ``cell_timeout``, when given, is the
    ``COURSE_GRADING_CELL_TIMEOUT`` that the worker's :class:`CellTimeLimit` reads (over the
    exercise's own limit, and over one that ``base`` has)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("COURSE_GRADING_TIMEOUT", str(GRADING_TIMEOUT_S))
    if cell_timeout is not None:
        env[CELL_TIMEOUT_ENV] = str(cell_timeout)
    return env


def grade_many(submissions: list, autograders: list | None = None, root: Path | None = None,
               jobs: int = 1, time_limit: float = SUBMISSION_LIMIT_S, seed: int | None = None,
               on_report=None, progress: bool = False, cell_timeout: float | str | None = None) -> list[GradeReport]:
    """Grade several notebooks, ``jobs`` at a time, each in a worker process that is killed after
    ``time_limit`` s; then it is graded once more without the cell that was running, and a second
    stop scores every question zero, with the reason (:func:`_grade_in_process`); ``seed``: see
    :func:`grade`. ``cell_timeout``: seconds any cell of a submission may run, in the workers'
    environment only (:func:`grading_env`); None: ``COURSE_GRADING_CELL_TIMEOUT`` if this process
    has it, else the exercise's own limit. ValueError where the kernel's alarm could not hold it.

    ``on_report(report, done)`` is called as each submission finishes, with the reports so far in
    submission order (``course grade`` saves them there: a crash or Ctrl-C at the 39th of 40 keeps
    38). ``progress``: a bar of submissions graded. Ctrl-C kills the running workers before it
    is raised."""
    autograders = list(autograders) if autograders is not None else [None] * len(submissions)
    if len(autograders) != len(submissions):
        raise ValueError("give one autograder per submission (or none)")
    if not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 seconds, got {time_limit!r}")
    if cell_timeout is not None:  # nan, inf or past a C int: every submission would score zero
        check_cell_timeout(cell_timeout, "cell_timeout")
    work = [(str(Path(s).resolve()), str(Path(a or find_autograder(Path(s), root)).resolve()))
            for s, a in zip(submissions, autograders)]
    env, workers = grading_env(cell_timeout=cell_timeout), _Workers()
    reports: list[GradeReport | None] = [None] * len(work)
    with ThreadPoolExecutor(max(1, min(jobs, len(work)))) as pool:
        futures = {pool.submit(_grade_in_process, *w, time_limit, env, seed, workers): i for i, w in enumerate(work)}
        try:
            with progress_bar(total=len(work), desc="grading", unit="submission", disable=not progress) as bar:
                for future in as_completed(futures):
                    reports[futures[future]] = future.result()
                    if on_report is not None:
                        on_report(reports[futures[future]], [r for r in reports if r is not None])
                    bar.update(1)
        except BaseException:  # Ctrl-C or an error in on_report: nothing may go on grading
            for future in futures:
                future.cancel()
            workers.stop()
            raise
    return reports


def _main(argv: list[str]) -> int:
    """The worker: grade one submission in this process, write the report as JSON."""
    submission, autograder, out, seed = argv
    try:
        report = grade(submission, autograder, seed=int(seed)).to_dict()
    except Exception as e:  # noqa: BLE001 - reported as the submission's error
        report = _stopped_report(submission, autograder, f"{type(e).__name__}: {e}", 0.0, int(seed)).to_dict()
    Path(out).write_text(json.dumps(report), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
