"""Run a notebook with nbclient, without waiting out a lost wake-up.

    from course_lib.notebook.runner import NotebookRunner
    NotebookRunner(nb, timeout=1800, kernel_name="python3").execute()   # nbclient's NotebookClient, same arguments

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
from queue import Empty

from nbclient import NotebookClient

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


class NotebookRunner(NotebookClient):
    """nbclient's NotebookClient, with its kernel's shell and IOPub channels polled in slices."""

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        poll_in_slices(kc.shell_channel)
        poll_in_slices(kc.iopub_channel)
        return kc
