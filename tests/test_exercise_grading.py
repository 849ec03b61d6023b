"""The grading helpers on their own: run_ranks and isolated never hang, references can be
forbidden, messages say expected vs found and the likely factor, the cell limit.

    python -m pytest tests/test_exercise_grading.py -q
"""

from __future__ import annotations

import importlib
import re
import sys
import time

import nbformat
import pytest

from course_lib import exercises
from course_lib.analysis import comm_cost as comm
from course_lib.analysis.comm_cost import collective_time


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


def _blank(rank, world_size):
    ...  # an answer whose body is still the release's ``...``: it returns None


def _checks_a_blank_answer(rank, world_size):
    from course_lib.exercises.grading import returned

    received, plan = returned(_blank(rank, world_size), f"dispatch(x, idx, {rank})")  # the test's line
    return received


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


# A student's cell that imports torch's functions by name: its globals hold them, not dist's attributes.
_STUDENTS_CELL = """
from torch.distributed import all_reduce, isend, recv

def ring_step(x, rank):
    if rank == 0:
        isend(x, 1).wait()
    else:
        recv(x, 0)
    all_reduce(x)
"""


def _from_imported(rank, world_size):
    """Sends through names imported from torch.distributed count, and its collectives raise."""
    import torch

    from course_lib.exercises.grading import p2p_only

    cell: dict = {}
    exec(_STUDENTS_CELL, cell)  # noqa: S102 - the notebook's globals
    with p2p_only(cell["ring_step"]) as sent:
        try:
            cell["ring_step"](torch.zeros(5, dtype=torch.float64), rank)
            refused = ""
        except RuntimeError as e:
            refused = str(e)
    restored = cell["isend"] is torch.distributed.isend and cell["all_reduce"] is torch.distributed.all_reduce
    return sent.bytes, sent.messages, refused, restored


@pytest.mark.timeout(120)
def test_p2p_only_counts_and_refuses_functions_imported_by_name():
    from course_lib.exercises.grading import run_ranks

    (bytes0, messages0, refused0, restored0), (bytes1, _, refused1, restored1) = run_ranks(_from_imported, 2)
    assert (bytes0, messages0, bytes1) == (40, 1, 0)
    assert "dist.all_reduce is not allowed here" in refused0 and "not allowed" in refused1
    assert restored0 and restored1


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
    # a check that fails on a rank: the rank's traceback ends at the test's line, not in grading.py
    with pytest.raises(RankError, match=r"rank (\d) failed: AssertionError: dispatch\(x, idx, \1\) returned None") as e:
        run_ranks(_checks_a_blank_answer, 2, timeout=30)  # whichever rank fails first
    rank_tb = str(e.value)
    assert re.search(r"AssertionError: dispatch\(x, idx, \d\) returned None \(does the function return its result\?\)$",
                     rank_tb.rstrip()), rank_tb
    assert "in _checks_a_blank_answer" in rank_tb and "exercises/grading.py" not in rank_tb, rank_tb
    (b0, refused0, total0), (b1, _, total1) = run_ranks(_p2p, 2, timeout=30)
    assert (b0, b1) == (40, 0) and "not allowed" in refused0 and total0 == total1 == 2.0


@pytest.mark.timeout(120)
def test_cell_time_limit_stops_an_endless_cell_and_grading_goes_on():
    from course_lib.exercises.runner import NotebookRunner

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("while True:\n    pass"),
        nbformat.v4.new_code_cell("y = x + 1\ny"),
    ])
    plugin = exercises.CellTimeLimit("sub.ipynb", {}, {"cell_timeout": 2})
    nb = plugin.before_execution(nb)
    nb.cells.append(nbformat.v4.new_code_cell("import time\ntime.sleep(3)\n'tests ran'"))  # otter's cell
    NotebookRunner(nb, timeout=60, kernel_name="python3", allow_errors=True).execute()
    loop, after, last = nb.cells[2], nb.cells[3], nb.cells[-1]
    assert loop.outputs[0]["ename"] == "TimeoutError" and "longer than 2 s" in loop.outputs[0]["evalue"]
    assert after.outputs[0]["data"]["text/plain"] == "2"
    assert last.outputs[0]["data"]["text/plain"] == "'tests ran'"  # disarmed before otter's cells


def _forever():
    while True:
        pass


def _ring_time():
    return comm.collective_time("all_reduce", 1e6, 4, bandwidth=1e9, algorithm="ring")


def _ring_time_imported_by_name():
    return collective_time("all_reduce", 1e6, 4, bandwidth=1e9, algorithm="ring")


def _fails():
    assert 1 + 1 == 3, "expected 3, found 2"


def _crashes():
    return {}["missing"]


@pytest.mark.timeout(120)
def test_isolated_returns_stops_forbids_and_reports():
    from course_lib.exercises.grading import AnswerTimeoutError, isolated

    assert isolated(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(AnswerTimeoutError, match="ran longer than 1 s"):  # killed, not waited for
        isolated(_forever, timeout=1)
    with pytest.raises(AssertionError, match="expected 3, found 2"):
        isolated(_fails)
    with pytest.raises(AssertionError, match="the answer raised KeyError: 'missing'"):
        isolated(_crashes)
    for fn in (_ring_time, _ring_time_imported_by_name):  # module attribute or a copied name
        with pytest.raises(AssertionError, match="asks you to write yourself"):
            isolated(fn, forbid=[comm.collective_time])
    assert _ring_time() > 0  # only the child's copy was disabled


def _earlier_answer(x):  # stands for a notebook's answer to an earlier question (a wrong one)
    return 2 * x + 1


def _later_answer(x):  # a later question's answer that calls it
    return _earlier_answer(x) * 10


def test_stand_ins_grade_a_question_on_its_own_in_the_child_only():
    """A mistake in an earlier answer is not charged again: the later answer sees the right one."""
    from course_lib.exercises.grading import isolated

    assert isolated(lambda: _later_answer(3)) == 70  # the wrong earlier answer shows through
    assert isolated(lambda: _later_answer(3), stand_ins={_later_answer: {"_earlier_answer": lambda x: x}}) == 30
    assert _later_answer(3) == 70 and _earlier_answer(3) == 7  # this process kept its own


def test_messages_say_expected_found_and_the_factor():
    import torch

    from course_lib.exercises.grading import assert_close, assert_number, fresh_copy, returned

    with pytest.raises(AssertionError, match=r"expected 1, found 3.*a factor of the world size too many"):
        assert_close([torch.ones(3) * 3], [torch.ones(3)], "grads", factors={"the world size": 3})
    with pytest.raises(AssertionError, match=r"expected 0.16, found 0.04.*divided by p once too often"):
        assert_number(0.04, 0.16, "ring", factors={"p": 4})
    with pytest.raises(AssertionError, match=r"expected 2, found 5 \(off by one\?\)"):
        assert_number(5, 2, "steps", hint="off by one?")
    assert_number(0.1 + 0.2, 0.3, "sum")  # within the tolerance
    # NaN compares false with everything: "difference > tolerance" once let it pass every numeric check
    # (a softmax that overflows on the hidden test's large logits scored full marks)
    for nan in (float("nan"), torch.tensor(float("nan")), "nan"):
        with pytest.raises(AssertionError, match=r"loss: expected 722.48, found nan \(an overflow"):
            assert_number(nan, 722.48, "loss")
    with pytest.raises(AssertionError, match=r"ring: expected the number 0.16, found None \(does the function return"):
        assert_number(None, 0.16, "ring")
    with pytest.raises(AssertionError, match=r"expected 0.16, found inf"):
        assert_number(float("inf"), 0.16, "ring")
    assert returned(0, "f(0)") == 0 and returned([], "f()") == []  # falsy values are answers too
    with pytest.raises(AssertionError, match=r"^dispatch\(x\) returned None \(does the function return its result\?\)$"):
        returned(None, "dispatch(x)")
    # a fresh copy does not see a patch of the imported module
    import course_lib.exercises.grading as imported

    saved = imported.assert_close
    imported.assert_close = lambda *a, **k: None
    try:
        with pytest.raises(AssertionError):
            fresh_copy().assert_close([torch.zeros(1)], [torch.ones(1)])
    finally:
        imported.assert_close = saved


def test_p2p_only_refuses_the_courses_own_ring_however_imported():
    import torch

    from course_lib.exercises.grading import p2p_only
    from course_lib.parallel.data import ring
    from course_lib.parallel.data.ring import ring_all_reduce as copied  # a student's `from ... import`

    with p2p_only(), pytest.raises(RuntimeError, match="course's own ring all-reduce"):
        copied(torch.zeros(4))
    with p2p_only(), pytest.raises(RuntimeError, match="write the ring yourself"):
        ring.ring_step([torch.zeros(1)], "all-gather", 0)
    assert copied.__code__.co_name == "ring_all_reduce" and ring.ring_step.__code__.co_name == "ring_step"


# A stand-in for the grading worker (grade._worker_argv): a "slow" submission never finishes, any
# other writes a report at once, in the worker's format.
_FAKE_WORKER = """
import json, sys, time
submission, autograder, report = sys.argv[1:4]
if "slow" in submission:
    time.sleep(120)
json.dump({"submission": submission, "autograder": autograder, "questions":
           [{"name": "q1", "score": 1.0, "possible": 2.0}]}, open(report, "w"))
"""


def _fake_batch(tmp_path, monkeypatch, names):
    grade = importlib.import_module("course_lib.exercises.grade")  # the package's name `grade` is a function
    monkeypatch.setattr(grade, "_worker_argv", lambda sub, ag, out, seed: [sys.executable, "-c", _FAKE_WORKER,
                                                                             sub, ag, str(out)])
    subs = []
    for name in names:
        subs.append(tmp_path / f"{name}.ipynb")
        subs[-1].write_text(name)
    return subs, [tmp_path / "ag.zip"] * len(subs)


@pytest.mark.timeout(60)
def test_a_batch_reports_each_submission_as_it_finishes(tmp_path, monkeypatch):
    """on_report sees the reports so far in submission order (course grade saves them there)."""
    subs, zips = _fake_batch(tmp_path, monkeypatch, ["ada", "bo", "cy"])
    seen = []
    reports = exercises.grade_many(subs, zips, jobs=2, on_report=lambda r, done: seen.append(
        (r.student, [d.student for d in done])))
    assert [r.student for r in reports] == ["ada", "bo", "cy"] and [r.total for r in reports] == [1.0] * 3
    assert sorted(s for s, _ in seen) == ["ada", "bo", "cy"]
    for student, done in seen:
        assert student in done and done == sorted(done)  # in submission order, whatever finished first
    assert [len(done) for _, done in seen] == [1, 2, 3]


@pytest.mark.timeout(60)
def test_ctrl_c_stops_the_running_workers(tmp_path, monkeypatch):
    """Each worker is a session of its own (the terminal's Ctrl-C does not reach it): a stopped
    batch must kill them, not wait for them or leave them running as orphans."""
    import psutil

    subs, zips = _fake_batch(tmp_path, monkeypatch, ["fast", "slow1", "slow2"])

    def interrupt(report, done):
        raise KeyboardInterrupt

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        exercises.grade_many(subs, zips, jobs=3, on_report=interrupt)
    assert time.monotonic() - t0 < 30, "it waited for the slow workers"  # each sleeps 120 s
    left = [p for p in psutil.process_iter(["cmdline"]) if any("slow" in a for a in (p.info["cmdline"] or []))
            and str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"] for p in left]


def test_course_grade_checks_where_it_writes_before_grading(tmp_path, capsys):
    from course_lib.exercises.cli import grade_cli

    sub = tmp_path / "ada.ipynb"
    sub.write_text("{}")
    (tmp_path / "a_file").write_text("")
    for flags, msg in [(["--csv", str(tmp_path / "a_file" / "grades.csv")], "--csv: cannot make the folder"),
                       (["--csv", str(tmp_path)], "is a folder; give a file name"),
                       (["--feedback", str(tmp_path / "a_file")], "is a file; give a folder")]:
        assert grade_cli([str(sub), "--autograder", str(tmp_path / "a_file"), *flags]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err


def test_a_report_keeps_the_diagnosis_of_a_long_failure():
    """A report line per failure used to be the traceback's last six lines: torch's frames, without
    the test's name or the course's own diagnosis (which ranks never joined)."""
    grade = importlib.import_module("course_lib.exercises.grade")
    frames = [f'  File "/site-packages/torch/distributed/distributed_c10d.py", line {n}, in send\n    work.wait()\n'
              "           ^^^^^^^^^^^^^^^^^^^^^" for n in range(6)]
    message = ("q1_ring_all_reduce - 1: Error at line 25 in test q1_ring_all_reduce:\n"
               "      for rank, got in enumerate(grading.run_ranks(worker, 2)):\n"
               "RanksTimeoutError: the 2 ranks did not finish within 10 s (is there a collective or a receive "
               "that some rank never joined?); rank 1 still waiting\nTraceback (most recent call last):\n"
               + "\n".join(frames) + "\nRuntimeError: Timed out waiting 10000ms for send operation to complete")
    lines = grade.brief(message)
    assert lines[0].startswith("q1_ring_all_reduce - 1: Error at line 25")
    assert lines[1].startswith("RanksTimeoutError: the 2 ranks did not finish") and lines[2] == "..."
    assert lines[-1] == "RuntimeError: Timed out waiting 10000ms for send operation to complete"
    assert len(lines) == 7 and not any(set(ln.strip()) <= set("^") for ln in lines)
    assert grade.brief("q2 - 1: Error at line 3:\nAssertionError: expected 2, found 5") == [
        "q2 - 1: Error at line 3:", "AssertionError: expected 2, found 5"]
    # what a student's feedback shows of a public test starts at the exception, not at otter's header
    assert grade._last_error(message).startswith("RanksTimeoutError: the 2 ranks")


def test_the_cell_a_stopped_grading_names_is_skipped_in_the_second(tmp_path):
    from course_lib.exercises.cell_limit import CELL_LOG_ENV, running_cell, running_cell_log
    from course_lib.exercises.grade import _skip_cell

    stuck = "\ntotal = sum(range(10**15))  # blocks in C\nprint(total)"
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_markdown_cell(stuck),
        nbformat.v4.new_code_cell(stuck, outputs=[nbformat.v4.new_output("stream", text="old")]),
        nbformat.v4.new_code_cell("y = x + 1")])
    sub = tmp_path / "sub" / "07_fabric.ipynb"
    sub.parent.mkdir()
    nbformat.write(nb, sub)
    log = tmp_path / "cell.txt"  # as the kernel's pre_run_cell hook writes it (CellTimeLimit.ARM)
    log.write_text("total = sum(range(10**15))  # blocks in C\n" + stuck, encoding="utf-8")
    env = {CELL_LOG_ENV: str(log)}
    first, source = running_cell_log(env)
    assert first == running_cell(env) == "total = sum(range(10**15))  # blocks in C" and source == stuck
    assert running_cell_log({}) == ("", "")
    copy = _skip_cell(str(sub), source, 20, tmp_path / "again")
    assert copy == tmp_path / "again" / "07_fabric.ipynb"
    cells = nbformat.read(copy, as_version=4).cells
    assert [c.source for c in cells[:2]] == ["x = 1", stuck] and cells[3].source == "y = x + 1"  # markdown kept
    assert cells[2].source.startswith("# total = sum(range(10**15))  # blocks in C\nraise TimeoutError(")
    assert "limit of 20 s" in cells[2].source and cells[2].outputs == []
    assert _skip_cell(str(sub), "z = 3", 20, tmp_path / "none") is None  # no such cell: nothing to skip
    assert _skip_cell(str(sub), "", 20, tmp_path / "none") is None  # the grader's own cells


def test_a_long_temporary_folder_moves_the_job_folder_where_a_socket_fits(monkeypatch):
    """A worker's fork-server socket lives under its job folder: under a long $TMPDIR it would be
    longer than an AF_UNIX path may be, and every question on ranks would fail."""
    import tempfile

    from course_lib.exercises.grade import _job_parent
    from course_lib.launch.ranks import AF_UNIX_PATH_MAX, FORKSERVER_SOCKET_TAIL

    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    assert _job_parent() is None  # the grader's own temporary folder
    long = "/scratch/" + "x" * 60
    monkeypatch.setattr(tempfile, "tempdir", long)
    assert len(long) + len("/course_grade_job_XXXXXXXX/tmp") + FORKSERVER_SOCKET_TAIL > AF_UNIX_PATH_MAX
    assert _job_parent() == "/tmp"
