"""The notebook runner: nbclient's client, its channels polled in slices (course_lib.exercises.runner).

    python -m pytest tests/test_notebook_runner.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from queue import Empty

import nbformat
import pytest

from course_lib.exercises.runner import NotebookRunner, poll_in_slices


class LostWakeUp:
    """A channel whose poll is never woken: a message that arrives while it waits is returned only
    when its timeout runs out (what nbclient issue #312 shows on the kernel's shell socket)."""

    def __init__(self, arrives_after_s: float | None):
        self.t0 = time.monotonic()
        self.arrives = None if arrives_after_s is None else self.t0 + arrives_after_s

    def arrived(self) -> bool:
        return self.arrives is not None and time.monotonic() >= self.arrives

    async def get_msg(self, timeout: float | None = None):
        if not self.arrived():
            await asyncio.sleep(3600 if timeout is None else timeout)
        if self.arrived():
            return {"msg": "reply"}
        raise Empty


def _time(channel, timeout):
    t0 = time.monotonic()
    try:
        result = asyncio.run(channel.get_msg(timeout=timeout))
    except Empty:
        result = Empty
    return result, time.monotonic() - t0


def test_a_lost_wake_up_costs_one_slice_not_the_timeout():
    raw, took = _time(LostWakeUp(arrives_after_s=0.2), timeout=3)
    assert raw == {"msg": "reply"} and took >= 3  # the stall, as nbclient meets it
    sliced = LostWakeUp(arrives_after_s=0.2)
    poll_in_slices(sliced, slice_s=0.25)
    got, took = _time(sliced, timeout=3)
    assert got == {"msg": "reply"} and took < 1
    waiting = LostWakeUp(arrives_after_s=0.6)  # no timeout: the same, without end
    poll_in_slices(waiting, slice_s=0.25)
    got, took = _time(waiting, timeout=None)
    assert got == {"msg": "reply"} and 0.6 <= took < 1.5


def test_the_timeout_still_ends_the_wait():
    never = LostWakeUp(arrives_after_s=None)
    poll_in_slices(never, slice_s=0.25)
    got, took = _time(never, timeout=0.6)
    assert got is Empty and 0.6 <= took < 1.2
    got, took = _time(never, timeout=0)
    assert got is Empty and took < 0.2


@pytest.mark.timeout(120)
def test_it_runs_a_notebook_with_a_widget_as_nbclient_does(monkeypatch):
    """A real kernel: the explorer-like cell of lesson 01, its output and the next cell's."""
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import ipywidgets as widgets\n"
                                  "w = widgets.interactive(lambda n: print('n =', n), n=widgets.IntSlider(value=3))\n"
                                  "w"),
        nbformat.v4.new_code_cell("print('after the widget')"),
        nbformat.v4.new_code_cell("1 / 0"),
    ])
    runner = NotebookRunner(nb, timeout=60, kernel_name="python3", allow_errors=True)
    polls = []
    runner.on_cell_executed = lambda **_: polls.append(runner.kc.iopub_channel.get_msg.__name__)
    runner.execute()
    assert polls == ["get_msg_in_slices"] * 3
    widget, after, error = nb.cells
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in widget.outputs)
    assert after.outputs[0]["text"] == "after the widget\n"
    assert error.outputs[0]["ename"] == "ZeroDivisionError"  # errors are nbclient's, unchanged


@pytest.mark.timeout(120)
def test_another_librarys_client_polls_in_slices_within_the_context(monkeypatch):
    """nbconvert's ExecutePreprocessor (what otter-grader runs, `course grade`'s path) inside
    every_client_polls_in_slices, and as it was once outside."""
    from nbclient import NotebookClient
    from nbconvert.preprocessors import ExecutePreprocessor

    from course_lib.exercises.runner import every_client_polls_in_slices

    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    original, sync = NotebookClient.async_start_new_kernel_client, NotebookClient.start_new_kernel_client

    def run():
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
        ep = ExecutePreprocessor(timeout=None, kernel_name="python3")
        polls = []
        ep.on_cell_executed = lambda **_: polls.append(ep.kc.shell_channel.get_msg.__name__)
        ep.preprocess(nb, {"metadata": {"path": "."}})
        assert nb.cells[0].outputs[0]["text"] == "42\n"
        return polls

    with every_client_polls_in_slices():
        assert run() == ["get_msg_in_slices"]
    assert NotebookClient.async_start_new_kernel_client is original and NotebookClient.start_new_kernel_client is sync
    assert run() == ["get_msg"]


@pytest.mark.timeout(120)
def test_within_the_context_a_kernel_that_never_answers_is_replaced(monkeypatch, tmp_path):
    """A kernel spec whose first kernel never answers (it sleeps before starting ipykernel) and
    whose next one does, and a client that waits 2 s for a kernel: outside the context the client
    fails as nbclient does; inside it, with ``kernel_starts=2``, the second kernel runs the
    notebook and the silent one is gone."""
    import json
    import sys

    import psutil
    from nbconvert.preprocessors import ExecutePreprocessor

    from course_lib.exercises.runner import every_client_polls_in_slices

    marker = tmp_path / "started_once"
    spec = tmp_path / "kernels" / "silent_once"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "display_name": "silent once", "language": "python",
        "argv": [sys.executable, "-c", f"import os, time; first = not os.path.exists({str(marker)!r}); "
                 f"open({str(marker)!r}, 'a').close(); time.sleep(3600 if first else 0); "
                 "from ipykernel import kernelapp; kernelapp.launch_new_instance()", "-f", "{connection_file}"]}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")

    def run():
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
        ExecutePreprocessor(timeout=60, startup_timeout=2, kernel_name="silent_once",
                            shutdown_kernel="immediate").preprocess(nb, {"metadata": {"path": str(tmp_path)}})
        return nb.cells[0].outputs[0]["text"]

    def sleepers():
        found = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):  # one that ended meanwhile (another test's, a zombie)
                if "3600 if first" in " ".join(p.cmdline()):
                    found.append(p)
        return found

    with pytest.raises(RuntimeError, match="Kernel didn't respond"):
        run()
    marker.unlink()
    with every_client_polls_in_slices(kernel_starts=2):
        assert run() == "42\n"
    assert marker.exists() and sleepers() == []
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="kernel_starts"), every_client_polls_in_slices(kernel_starts=bad):
            pass
