"""Run a notebook with nbclient, without waiting out a lost wake-up.

    from course_lib.exercises.runner import NotebookRunner, every_client_polls_in_slices
    NotebookRunner(nb, timeout=1800, kernel_name="python3").execute()   # nbclient's NotebookClient, same arguments
    with every_client_polls_in_slices():                                # another library's client (otter's)
        ...

nbclient waits for a cell's reply with one poll of the kernel's shell socket that lasts the whole
cell timeout. Now and then that poll is not woken when the reply arrives, and it returns the reply
only when its timeout runs out. The reported cases are cells that show ipywidgets (nbclient issue
#312, "when cell contains ipywidget, execute cell will sometimes blocks", open in 2026). Here it
happened once in about two dozen Colab-wheel runs of lesson 01: its explorer widget's cell
answered in 0.1 s, and the next cell started 180 s later, the test's cell timeout. In full mode
(``make book``: 1800 s per cell) that one stall would be half an hour.

:class:`NotebookRunner` is nbclient's client with its shell and IOPub channels polled in slices of
``POLL_S`` seconds up to the same deadline, so a lost wake-up costs at most one slice. Every
other behaviour, the timeouts and errors included, is nbclient's.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from queue import Empty

from jupyter_core.utils import run_sync
from nbclient import NotebookClient

from course_lib.utils import check_count

POLL_S = 1.0  # the longest wait for a message that has already arrived


def poll_in_slices(channel, slice_s: float = POLL_S) -> None:
    """Make ``channel.get_msg(timeout)`` (an async jupyter_client channel) wait in polls of at
    most ``slice_s`` seconds until ``timeout`` (None: without end); Empty when it runs out."""
    get_msg = channel.get_msg

    async def get_msg_in_slices(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = slice_s if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await get_msg(timeout=min(slice_s, left))
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    channel.get_msg = get_msg_in_slices


def _poll_kernel_in_slices(kc) -> None:
    poll_in_slices(kc.shell_channel)
    poll_in_slices(kc.iopub_channel)


class NotebookRunner(NotebookClient):
    """nbclient's NotebookClient, with its kernel's shell and IOPub channels polled in slices."""

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        _poll_kernel_in_slices(kc)
        return kc

    start_new_kernel_client = run_sync(async_start_new_kernel_client)  # setup_kernel's (nbclient binds its own)


@contextmanager
def every_client_polls_in_slices(kernel_starts: int = 1):
    """Within: every nbclient client that this process starts polls in slices, those of other
    libraries too (nbconvert's ExecutePreprocessor, which otter-grader runs, has no timeout, so
    a lost wake-up there would wait until the grader's limit for the submission). Not thread-safe:
    for a process that runs one notebook at a time, such as ``course grade``'s worker.

    ``kernel_starts``: how many kernels a client may start, each time the last one did not answer
    within its ``startup_timeout`` (nbclient's default: 60 s) or died before answering. Nothing of
    the notebook has run by then. A kernel answers in about a second, also where ten notebooks
    start at once on 2 cores (0.5-1.7 s, 49 starts in ``course grade``'s test); in the course's CI
    one kernel among a few thousand never did, and its submission lost every point to the grading
    machine."""
    check_count("kernel_starts", kernel_starts)
    start, start_sync = NotebookClient.async_start_new_kernel_client, NotebookClient.start_new_kernel_client

    async def start_polling_in_slices(self):
        for _ in range(kernel_starts - 1):
            try:
                kc = await start(self)
                break
            except RuntimeError:  # jupyter_client: "Kernel didn't respond ..." / "Kernel died before replying ..."
                # nbclient has shut the silent kernel down and dropped its manager: a new kernel
                self.km = self.create_kernel_manager()
                await self.async_start_new_kernel()
        else:  # the last kernel: its failure is the client's
            kc = await start(self)
        _poll_kernel_in_slices(kc)
        return kc

    # both: the synchronous one (setup_kernel's, which nbconvert's preprocess uses) wraps the original
    NotebookClient.async_start_new_kernel_client = start_polling_in_slices
    NotebookClient.start_new_kernel_client = run_sync(start_polling_in_slices)
    try:
        yield
    finally:
        NotebookClient.async_start_new_kernel_client, NotebookClient.start_new_kernel_client = start, start_sync
