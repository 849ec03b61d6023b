"""The otter plugin that bounds every cell of a submission while it is graded."""

from __future__ import annotations

import os

CELL_TIMEOUT_ENV = "COURSE_GRADING_CELL_TIMEOUT"


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
        # nbformat only inside otter's grading run, where a submission is read
        import nbformat

        if isinstance(submission, str):  # a .py submission: nothing to bound per cell
            return submission
        submission.cells.insert(0, nbformat.v4.new_code_cell(self.ARM.format(seconds=self.seconds())))
        submission.cells.append(nbformat.v4.new_code_cell(self.DISARM))
        return submission

    # otter calls only the events a plugin has (hasattr), so the others are simply absent.
