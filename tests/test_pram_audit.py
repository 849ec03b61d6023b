"""Audit of the PRAM simulator: bad input named clearly, edge cases that used to crash.

Model definitions: J. JaJa, An Introduction to Parallel Algorithms (1992), sec. 1.2.
"""

import operator

import pytest

from course_lib import pram
from course_lib.pram import AccessViolation, PRAMError, run


def _everyone_reads_a0(pid, step, mem):
    """Both processors read A[0] (a concurrent read) and each writes its own cell."""
    mem["A"][1 - pid] = mem["A"][0]
    mem.op("copy")


# ------------------------------------------------------------------ memory layout

@pytest.mark.parametrize("ragged", [
    [[1, 2], [3, 4, 5], [6]],        # 6 values, so shape (3, 2) used to fit them silently
    [[1, 2], 3],                     # a row that is not a list
    [[1, 2], [3, [4]]],              # a cell one level deeper than the first
])
def test_a_ragged_nested_list_is_rejected_not_silently_reshaped(ragged):
    with pytest.raises(ValueError, match=r"W.*ragged"):
        pram.Memory({"W": ragged})
    with pytest.raises(ValueError, match=r"W.*ragged"):
        run(_everyone_reads_a0, "CREW", processors=2, memory={"A": [1, 2], "W": ragged},
            steps=1)


def test_rectangular_nested_lists_still_load():
    mem = pram.Memory({"W": [[1, 2], [3, 4], [5, 6]], "E": [], "T": ((1, 2), (3, 4))})
    assert mem["W"] == [[1, 2], [3, 4], [5, 6]]
    assert mem.shapes == {"W": (3, 2), "E": (0,), "T": (2, 2)}


def test_an_empty_array_does_not_break_locations_of_the_array_at_its_address():
    """An empty array shares its base address with the next array; a concurrent read of that
    array's first cell used to divide by the empty array's size (ZeroDivisionError)."""
    r = run(_everyone_reads_a0, "CREW", processors=2, memory={"B": [], "A": [1, 2]}, steps=1)
    assert r["A"] == [1, 1]
    assert r.max_readers.location == "A[0]"
    assert "A[0]" in pram.render_step(r, 0)
    with pytest.raises(AccessViolation) as err:
        run(_everyone_reads_a0, "EREW", processors=2, memory={"B": [], "A": [1, 2]}, steps=1)
    assert err.value.location == "A[0]"


# ------------------------------------------------------------------ run(steps=...)

@pytest.mark.parametrize("steps", [-1, 1.5, "2", True])
def test_a_bad_number_of_steps_is_an_error_naming_steps(steps):
    """steps=-1 used to run 0 steps and steps=1.5 two steps, silently."""
    with pytest.raises(ValueError, match="steps must be"):
        run(_everyone_reads_a0, "CREW", processors=2, memory={"A": [1, 2]}, steps=steps)


def test_zero_and_positive_steps_still_run():
    assert run(_everyone_reads_a0, "CREW", processors=2, memory={"A": [1, 2]}, steps=0).steps == 0
    assert run(_everyone_reads_a0, "CREW", processors=2, memory={"A": [1, 2]}, steps=3).steps == 3


# ------------------------------------------------------------------ classify with Model objects

def test_classify_accepts_a_custom_combining_model():
    """run() takes a Model made by combining(); classify() used to find it correct and then
    fail with "unknown PRAM model" while writing the reason."""
    add = pram.combining(operator.add, "CRCW-add")
    program = pram.grad_accumulate(4, 3)
    assert program.verify(run(program, add)) == []
    verdict = pram.classify(program, models=["EREW", "CREW", add])
    assert verdict.model == "CRCW-add"
    assert "combined (add)" in verdict.reason
    assert [a.model for a in verdict.attempts] == ["EREW", "CREW", "CRCW-add"]


def test_classify_with_model_objects_that_all_fail_names_them():
    with pytest.raises(PRAMError, match="runs correctly under none of: EREW, CREW"):
        pram.classify(pram.grad_accumulate(4, 3), models=[pram.MODELS["EREW"], "CREW"])


def test_a_phase_of_zero_processors_or_a_bad_step_count_is_refused():
    """phases((fn, 1, 0)) ran every processor (the machine read 0 as "all of them")."""
    def write(pid, step, mem):
        mem["A"][pid] = 1

    for part, what in (((write, 1, 0), "processors of write"), ((write, -1), "steps of write"),
                       ((write, 1.5, 2), "steps of write"), ((write, 1, True), "processors of write")):
        with pytest.raises(ValueError, match=f"phases: {what} must be a whole number"):
            pram.phases(part)
    program = pram.Program("two of three", pram.phases((write, 1, 2)), processors=3, memory={"A": [0, 0, 0]},
                           steps=1)
    assert run(program, "EREW")["A"] == [1, 1, 0]  # the third idles


def test_an_index_that_is_no_whole_number_names_the_processor_and_the_array():
    """mem["A"][pid / 2] failed with a bare 'list indices must be integers'; mem["A"][True] wrote A[1]."""
    for index in (lambda pid: pid / 2, lambda pid: pid == 1, lambda pid: (0, 0.0)):
        def write(pid, step, mem, index=index):
            mem["A"][index(pid)] = pid

        program = pram.Program("halves", write, processors=2, memory={"A": [[0, 0], [0, 0]]}, steps=1)
        with pytest.raises(TypeError, match=r"processor 0 at step 0: index .* of A is not a whole number"):
            run(program, "CRCW-arbitrary")
