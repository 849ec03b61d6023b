"""The otter plugin that bounds every cell of a submission while it is graded."""

from __future__ import annotations

import os

from course_lib.utils import check_seconds

CELL_TIMEOUT_ENV = "COURSE_GRADING_CELL_TIMEOUT"
MAX_CELL_TIMEOUT_S = 2**31 - 1  # the longest signal.alarm takes (a C int): beyond it the alarm raises
CELL_LOG_ENV = "COURSE_GRADING_CELL_LOG"  # a file the kernel writes each cell to as it starts: its first line, then all of it


def check_cell_timeout(value, source: str) -> float:
    """A cell's time limit in seconds, from ``source`` (a flag, the environment variable, the
    assignment's config): a number > 0 that ``signal.alarm`` can hold, else a ValueError naming
    it (nan or inf failed the alarm's conversion in every cell: every submission scored zero)."""
    try:  # the environment's and a flag's text: a number, the rest as given (check_seconds names it)
        number = float(value) if isinstance(value, str) else value
    except ValueError:
        number = value
    seconds = check_seconds(source, number, allow_none=False)  # the one rule: finite, > 0
    if seconds > MAX_CELL_TIMEOUT_S:
        raise ValueError(f"{source} must be seconds > 0 and at most {MAX_CELL_TIMEOUT_S}, got {value!r}")
    return seconds


def running_cell_log(environ=os.environ) -> tuple[str, str]:
    """The submission's cell that was running last (from ``$COURSE_GRADING_CELL_LOG``): its first
    line, what a stopped or crashed grading names, and its whole source, what a second grading
    finds and skips (:mod:`course_lib.exercises.grade`). ("", "") when nothing was logged; the
    source is "" for the grader's own cells."""
    path = environ.get(CELL_LOG_ENV)
    try:
        text = open(path, encoding="utf-8").read() if path else ""
    except OSError:
        return "", ""
    first, _, source = text.partition("\n")
    return first.strip(), source


def running_cell(environ=os.environ) -> str:
    """The first line of :func:`running_cell_log`."""
    return running_cell_log(environ)[0]


class CellTimeLimit:
    """otter plugin: every cell of a submission gets at most ``cell_timeout`` seconds.

    Inserted as the first and last cells of the submission before otter adds its own: the first
    arms SIGALRM before each cell runs and raises ``TimeoutError`` in the kernel when it fires, the
    last disarms it so otter's own test-running cell is not cut short (the tests bound each
    check themselves, from outside: :func:`course_lib.exercises.grading.isolated` and
    ``run_ranks``). A cell can switch the alarm off; the submission's own time limit in
    :func:`grade_many` is the backstop. Configure in an exercise's assignment config
    (``generate: plugins: - course_lib.exercises.CellTimeLimit: {cell_timeout: 60}``); the
    environment variable ``COURSE_GRADING_CELL_TIMEOUT`` overrides it.
    """

    ARM = '''\
# course_lib.exercises.CellTimeLimit: no cell may run longer than {seconds} s during grading
import os as _course_os
import signal as _course_signal

def _course_cell_timeout(signum, frame):
    raise TimeoutError("this cell ran longer than {seconds} s during grading and was stopped "
                       "(an endless loop, or a process that never finished?)")

def _course_log_cell(first_line, raw=""):  # which cell runs: a cell that blocks in C code or kills the kernel is named
    if _course_os.environ.get("{log_env}"):
        with open(_course_os.environ["{log_env}"], "w", encoding="utf-8") as _course_f:
            _course_f.write(first_line[:120] + "\\n" + raw)

def _course_arm(*args):
    raw = getattr(args[0], "raw_cell", "") if args else ""
    _course_log_cell(next((line for line in raw.splitlines() if line.strip()), ""), raw)
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
_course_log_cell("(the grader's own cells, after the submission's)")
if hasattr(_course_signal, "SIGALRM"):
    _course_signal.alarm(0)
    get_ipython().events.unregister("pre_run_cell", _course_arm)
    get_ipython().events.unregister("post_run_cell", _course_disarm)
'''

    def __init__(self, submission_path, submission_metadata, plugin_config):
        self.submission_path = submission_path
        self.plugin_config = plugin_config or {}

    def seconds(self) -> int:
        if os.environ.get(CELL_TIMEOUT_ENV):
            return max(1, int(check_cell_timeout(os.environ[CELL_TIMEOUT_ENV], CELL_TIMEOUT_ENV)))
        return max(1, int(check_cell_timeout(self.plugin_config.get("cell_timeout", 120), "cell_timeout")))

    def before_execution(self, submission):
        # nbformat only inside otter's grading run, where a submission is read
        import nbformat

        if isinstance(submission, str):  # a .py submission: nothing to bound per cell
            return submission
        arm = self.ARM.format(seconds=self.seconds(), log_env=CELL_LOG_ENV)
        submission.cells.insert(0, nbformat.v4.new_code_cell(arm))
        submission.cells.append(nbformat.v4.new_code_cell(self.DISARM))
        return submission

    # otter calls only the events a plugin has (hasattr), so the others are simply absent.
