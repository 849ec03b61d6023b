"""Answers written differently from the reference solutions, run through the exercises' own test
functions (read from instructor/, called as otter calls them): a correct answer in another form
must pass them, and a subtle mistake that the public tests let through must fail a hidden one.
Each case was found by reading a question against its tests (what it guards is in its comment);
the typical mistakes that go through otter's whole grading are in instructor/grading_cases.py.

    python -m pytest tests/test_exercise_variants.py -q
"""

from __future__ import annotations

import re

import nbformat
import pytest

from course_lib import exercises
from course_lib.utils import repo_root


def question_tests(exercise: str, question: str) -> dict:
    """The test functions of ``question`` in the exercise's source, by name (public and hidden),
    each defined in a namespace of its own as otter's test files define them."""
    nb = nbformat.read(repo_root() / exercises.SOURCES / exercise / f"{exercise}.ipynb", as_version=4)
    tests, inside, in_tests = {}, False, False
    for cell in nb.cells:
        text = cell.source.strip()
        if cell.cell_type == "raw" and text.startswith("# BEGIN QUESTION"):
            inside = re.search(r"^name:\s*(\S+)", text, re.MULTILINE).group(1) == question
        elif cell.cell_type == "raw" and text in ("# BEGIN TESTS", "# END TESTS"):
            in_tests = text == "# BEGIN TESTS"
        elif inside and in_tests and cell.cell_type == "code":
            namespace = {"__name__": "exercise_tests"}  # not importable: pickled by value, as a notebook's
            exec(compile(cell.source, f"<{exercise} test>", "exec"), namespace)  # noqa: S102 - the course's own tests
            tests.update({k: v for k, v in namespace.items() if k.startswith("test_")})
    assert tests, f"no tests for {exercise}/{question}"
    return tests


def answers(source: str) -> dict:
    """A student's cell: the functions it defines, with the notebook's own imports."""
    namespace = {"__name__": "exercise_answers"}
    exec(compile(source, "<answer>", "exec"), namespace)  # noqa: S102 - a cell written here
    return namespace


@pytest.mark.timeout(120)
def test_a_prefix_sum_with_two_dimensional_or_filled_arrays_is_graded_on_its_values():
    # 04 q1: the hidden tests read every array of the initial memory as the simulator does: a list
    # of rows (one copy per level) and pram.filled once crashed them, blaming the answer
    answer = answers('''
import math
from course_lib import pram

def erew_prefix_sum(values):
    n = len(values)
    levels = max(1, math.ceil(math.log2(n)))

    def step(pid, s, mem):
        level, d = s // 2, 2 ** (s // 2)
        if s % 2 == 0:  # row `level` of B: this level's copy of A
            mem["B"][level, pid] = mem["A"][pid]
        elif pid >= d:
            mem["A"][pid] = mem["A"][pid] + mem["B"][level, pid - d]

    return pram.Program("rows", step, n, {"A": list(values), "B": [[0] * n for _ in range(levels)],
                                          "Z": pram.filled(2, 0)}, 2 * levels)
''')
    for test in question_tests("04_pram", "q1_erew_prefix_sum").values():
        test(answer["erew_prefix_sum"])  # raises on a failed check


@pytest.mark.timeout(120)
def test_a_weakest_model_that_tries_arbitrary_with_one_seed_loses_a_hidden_test():
    # 04 q2: the question asks for seeds 0, 1 and 2 under CRCW-arbitrary; with seed 0 alone every
    # kernel of the public and hidden lists passed, until a hidden program whose writers disagree
    answer = answers('''
from course_lib import pram
CANDIDATES = ["EREW", "CREW", "CRCW-common", "CRCW-arbitrary", "CRCW-priority", "CRCW-sum"]

def weakest_model_of(program):
    for model in CANDIDATES:
        try:
            if not program.verify(pram.run(program, model, trace=False, seed=0)):
                return model
        except pram.AccessViolation:
            continue
''')
    tests = question_tests("04_pram", "q2_weakest_model")
    with pytest.raises(AssertionError, match="writers-.*expected 'CRCW-priority', found 'CRCW-arbitrary'"):
        tests["test_other_kernels"](answer["weakest_model_of"])


@pytest.mark.timeout(120)
def test_a_peak_counted_before_the_first_backward_loses_a_hidden_test():
    # 06 q2: in every schedule the tests used, the peak comes just before the first backward, so
    # counting the forwards up to it passed; the question asks for the peak of any list
    answer = answers('''
from course_lib.parallel.pipeline.schedules import schedule_ops

def one_f_one_b(m, r, p):
    warmup = min(p - r - 1, m)
    ops, f, b = [("F", i) for i in range(warmup)], warmup, 0
    while f < m:
        ops += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    return ops + [("B", i) for i in range(b, m)]

def max_in_flight(ops):
    first_backward = next((i for i, (kind, _) in enumerate(ops) if kind == "B"), len(ops))
    return first_backward
''')
    tests = question_tests("06_model_parallel", "q2_one_f_one_b")
    with pytest.raises(AssertionError, match=r"max_in_flight of \[\('F', 0\), \('B', 0\)"):
        tests["test_many_stages_and_micro_batches"](answer["one_f_one_b"], answer["max_in_flight"])


@pytest.mark.timeout(180)
def test_a_ring_written_with_functions_imported_by_name_is_counted_and_passes():
    # 01 q1: the grader counted only calls through dist.*: a correct ring that imported isend and
    # recv by name sent "0 bytes" and failed the hidden test (its collectives were not refused)
    answer = answers('''
import torch
from torch.distributed import get_rank, get_world_size, isend, recv

def ring_all_reduce(tensor):
    p, r = get_world_size(), get_rank()
    chunks = tensor.view(-1).tensor_split(p)
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(p - 1):
            send = (r - s) % p if phase == "reduce-scatter" else (r - s + 1) % p
            into = (send - 1) % p
            incoming = torch.empty_like(chunks[into])
            request = isend(chunks[send].contiguous(), (r + 1) % p)
            recv(incoming, (r - 1) % p)
            request.wait()
            if phase == "reduce-scatter":
                chunks[into].add_(incoming)
            else:
                chunks[into].copy_(incoming)
    return tensor
''')
    question_tests("01_collectives", "q1_ring_all_reduce")["test_three_and_four_ranks_uneven_sizes_and_traffic"](
        answer["ring_all_reduce"])


@pytest.mark.timeout(180)
def test_the_courses_vocab_parallel_loss_behind_its_wrapper_is_refused():
    # 06 q1: "write your own": the tests disabled the course's function but not the autograd
    # function that does its work, which an answer could call directly
    answer = answers('''
from course_lib.parallel.comms import Comms
from course_lib.parallel.tensor.vocab import _VocabParallelCrossEntropy

def vocab_parallel_cross_entropy(local_logits, targets, vocab_start):
    return _VocabParallelCrossEntropy.apply(local_logits, targets, vocab_start, Comms()).mean()
''')
    for test in question_tests("06_model_parallel", "q1_vocab_parallel_cross_entropy").values():
        with pytest.raises(Exception, match="course's own implementation"):
            test(answer["vocab_parallel_cross_entropy"])
