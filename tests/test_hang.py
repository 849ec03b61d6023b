"""The deliberate hang of notebook 2: one rank skips an all-reduce, the collective timeout turns
the hang into an error naming the waiting rank; with the fix every rank synchronises."""

import re
import time

import pytest

from course_lib.experiments.hang import skip_a_collective
from course_lib.launch import NotebookLaunchError, notebook_launcher


@pytest.mark.timeout(120)
def test_skipped_collective_times_out_and_the_fix_synchronises():
    t0 = time.monotonic()
    with pytest.raises(NotebookLaunchError) as err:
        notebook_launcher(skip_a_collective, (1, 60.0), nproc=2, timeout=2)
    assert time.monotonic() - t0 < 50  # the timeout ended it, not the skipping rank's 60 s of work
    assert err.value.rank == 0
    # the waiting rank, the timeout and rank 1 named as the one that did not join
    expected = r"(?s)rank 0 failed.*collective timed out after 2 s.*did not join\?\): \[1\]"
    assert re.search(expected, str(err.value)), err.value

    results = notebook_launcher(skip_a_collective, (1, 60.0, True), nproc=2, timeout=10)
    assert [r["synchronised"] for r in results] == [True, True]
    assert results[0]["grads"] == results[1]["grads"] == [1.5] * 4  # the mean of 1 and 2
    assert notebook_launcher(skip_a_collective, (-1,), nproc=2, timeout=10)[1]["synchronised"]
