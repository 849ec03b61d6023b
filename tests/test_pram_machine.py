"""The PRAM simulator: every access rule, every violation message, and the counts.

Model definitions: JaJa, An Introduction to Parallel Algorithms (1992), sec. 1.2.
"""

import operator
import re

import numpy as np
import pytest

from course_lib import pram
from course_lib.pram import AccessViolation, ProcessorLimitError, allreduce, run


def _writes_at(step_no, writers, address, value=lambda pid: pid):
    """A program in which ``writers`` write ``address`` at step ``step_no``; before that every
    processor writes its own cell so the machine keeps running."""

    def step(pid, step, mem):
        if step < step_no:
            mem["A"][pid] = step
        elif step == step_no and pid in writers:
            mem["A"][address] = value(pid)

    return step


def _run_writes(model, writers, address=12, step_no=4, value=lambda pid: pid, **kw):
    return run(_writes_at(step_no, writers, address, value), model, processors=8,
               memory={"A": [0] * 16}, steps=step_no + 1, **kw)


def test_crew_concurrent_write_message_names_model_step_address_processors():
    with pytest.raises(AccessViolation) as err:
        _run_writes("CREW", {3, 5})
    e = err.value
    assert str(e).startswith("CREW: processors 3 and 5 wrote address 12 at step 4 (A[12])")
    assert (e.model, e.kind, e.step, e.address, e.processors) == ("CREW", "write", 4, 12, (3, 5))


def test_erew_concurrent_write_and_read_are_violations():
    msg = r"^EREW: processors 1, 2 and 6 wrote address 12 at step 4"
    with pytest.raises(AccessViolation, match=msg):
        _run_writes("EREW", {1, 2, 6})

    def readers(pid, step, mem):
        if step == 0:
            mem["B"][pid] = mem["A"][0] if pid in (2, 7) else mem["A"][pid]

    with pytest.raises(AccessViolation) as err:
        run(readers, "EREW", processors=8, memory={"A": [5] * 8, "B": [0] * 8})
    assert str(err.value).startswith("EREW: processors 0, 2 and 7 read address 0 at step 0 (A[0])")
    assert err.value.kind == "read"
    # the same program is legal with concurrent reads
    assert run(readers, "CREW", processors=8, memory={"A": [5] * 8, "B": [0] * 8})["B"] == [5] * 8


def test_one_processor_touching_an_address_twice_is_not_a_conflict():
    def twice(pid, step, mem):
        if step == 0:
            x = mem["A"][pid] + mem["A"][pid]
            mem["A"][pid] = x
            mem["A"][pid] = x + 1     # the processor's last write in the step counts

    r = run(twice, "EREW", processors=4, memory={"A": [1, 2, 3, 4]})
    assert r["A"] == [3, 5, 7, 9]


def test_reads_see_memory_as_it_was_when_the_step_began():
    def swap(pid, step, mem):      # a swap in one step needs the read phase before the writes
        if step == 0:
            mem["A"][1 - pid] = mem["A"][pid]

    assert run(swap, "EREW", processors=2, memory={"A": ["x", "y"]})["A"] == ["y", "x"]


def test_common_rule_accepts_agreeing_writers_and_rejects_disagreeing_ones():
    r = _run_writes("CRCW-common", {3, 5, 6}, value=lambda pid: 7)
    assert r["A"][12] == 7 and r.max_writers.count == 3 and r.max_writers.location == "A[12]"
    with pytest.raises(AccessViolation) as err:
        _run_writes("CRCW-common", {3, 5}, value=lambda pid: pid * 1.5)
    e = err.value
    assert str(e).startswith("CRCW-common: processors 3 and 5 wrote different values to "
                             "address 12 at step 4")
    assert e.kind == "disagree" and e.values == (4.5, 7.5)


def test_arbitrary_rule_stores_one_of_the_written_values_chosen_by_the_seed():
    winners = {_run_writes("CRCW-arbitrary", {1, 3, 5}, seed=s)["A"][12] for s in range(20)}
    assert winners == {1, 3, 5}
    assert (_run_writes("CRCW-arbitrary", {1, 3, 5}, seed=4)["A"][12]
            == _run_writes("CRCW-arbitrary", {1, 3, 5}, seed=4)["A"][12])


def test_priority_rule_lowest_processor_wins():
    assert _run_writes("CRCW-priority", {7, 2, 5}, value=lambda pid: pid * 10)["A"][12] == 20


@pytest.mark.parametrize("model, expected", [
    ("CRCW-sum", 2 + 5 + 6), ("CRCW-max", 6), ("CRCW-min", 2), ("CRCW-prod", 2 * 5 * 6),
])
def test_combining_rules(model, expected):
    assert _run_writes(model, {2, 5, 6})["A"][12] == expected


def test_logical_combining_rules_and_a_custom_operator():
    bits = lambda pid: int(pid == 5)  # noqa: E731
    assert _run_writes("CRCW-or", {2, 5}, value=bits)["A"][12] == 1
    assert _run_writes("CRCW-and", {2, 5}, value=bits)["A"][12] == 0
    # a non-commutative operator is applied in processor-id order, so it stays deterministic
    concat = pram.combining(operator.add, "CRCW-concat")
    letters = lambda pid: "abcdefgh"[pid]  # noqa: E731
    assert _run_writes(concat, {6, 1, 3}, value=letters)["A"][12] == "bdg"


def test_models_by_name_and_unknown_model():
    assert pram.get_model("crew") is pram.MODELS["CREW"]
    assert pram.get_model("crcw-SUM").rule == "combine"
    for name in ("EREW", "CREW", "CRCW-common", "CRCW-arbitrary", "CRCW-priority", "CRCW-sum",
                 "CRCW-max"):
        assert name in pram.MODELS
    with pytest.raises(ValueError, match=r"unknown PRAM model 'CRXW'; choose one of: EREW, CREW"):
        run(_writes_at(0, set(), 0), "CRXW", processors=1, memory={"A": [0]})


def test_work_and_time_counts_per_step():
    def prog(pid, step, mem):
        if step == 0:
            mem["B"][pid] = mem["A"][pid] * 2      # no op named: counts as one "op"
        elif step == 1 and pid < 2:
            mem["B"][pid] = mem["B"][pid] + mem["A"][pid + 2]
            mem.op("add")
            mem.op("mul", 3)

    r = run(prog, "EREW", processors=4, memory={"A": [1, 2, 3, 4], "B": [0] * 4})
    assert (r.steps, r.processors, r.work) == (2, 4, 4 + 2 * 4)
    assert r.ops == {"op": 4, "add": 2, "mul": 6}
    assert [(s.active, s.reads, s.writes) for s in r.per_step] == [(4, 4, 4), (2, 4, 2)]
    assert r["B"] == [5, 8, 6, 8]
    assert r.summary()["steps"] == 2 and r.summary()["work"] == 12
    table = r.table().splitlines()
    assert table[0].split() == ["step", "active", "reads", "writes", "ops"]
    assert table[-1].split() == ["total", "8", "6", "12"]


def test_fixed_steps_count_idle_steps_and_non_halting_programs_are_stopped():
    def idle(pid, step, mem):
        pass

    assert run(idle, "EREW", processors=2, memory={"A": [0]}, steps=5).steps == 5
    assert run(idle, "EREW", processors=2, memory={"A": [0]}).steps == 0

    def forever(pid, step, mem):
        mem["A"][pid] = step

    with pytest.raises(pram.PRAMError, match="did not halt within 50 steps"):
        run(forever, "EREW", processors=2, memory={"A": [0, 0]}, max_steps=50)


def test_more_processors_than_allowed_and_bad_processor_counts():
    prog = pram.tree_sum(64)
    with pytest.raises(ProcessorLimitError, match="tree-sum needs 32 processors, more than the 16 "
                                                  "allowed"):
        run(prog, max_processors=16)
    assert isinstance(ProcessorLimitError("x"), ValueError)
    with pytest.raises(ValueError, match="positive int"):
        run(lambda pid, step, mem: None, "EREW", processors=0, memory={"A": [0]})
    with pytest.raises(ValueError, match="needs processors= and memory="):
        run(lambda pid, step, mem: None, "EREW")


def test_bad_addresses_give_clear_errors():
    def off_the_end(pid, step, mem):
        mem["A"][pid + 1] = 0

    msg = r"processor 3 at step 0: index 4 is outside A of shape \(4,\)"
    with pytest.raises(IndexError, match=msg):
        run(off_the_end, "EREW", processors=4, memory={"A": [0] * 4})

    def unknown(pid, step, mem):
        mem["Z"][0] = 1

    with pytest.raises(KeyError, match="no array 'Z' in PRAM memory; arrays: A"):
        run(unknown, "EREW", processors=1, memory={"A": [0]})


def test_memory_layout_nested_arrays_and_locations():
    m = pram.Memory({"A": [1, 2, 3], "W": np.arange(6).reshape(2, 3), "s": 5.0})
    assert m.bases == {"A": 0, "W": 3, "s": 9}
    assert m["W"] == [[0, 1, 2], [3, 4, 5]] and m.flat("s") == [5.0]
    assert m.location(7) == "W[1, 1]" and m.location(9) == "s[0]"
    assert pram.filled((2, 2), 0.5).data == [0.5] * 4

    def rows(pid, step, mem):
        if step == 0:
            i, j = pram.coords(pid, (2, 3))
            mem["W"][i, j] = mem["W"][i, j] * 10

    assert run(rows, "EREW", processors=6, memory={"W": [[1, 2, 3], [4, 5, 6]]})["W"] == [
        [10, 20, 30], [40, 50, 60]]


def test_trace_render_and_slider():
    r = run(pram.tree_sum(8, values=list(range(8))))
    assert len(r.trace) == r.steps == 3
    t0 = r.trace[0]
    assert t0.writes == {0: (0,), 2: (1,), 4: (2,), 6: (3,)}
    assert t0.reads[1] == (0,) and t0.memory[:2] == [1, 1]
    html = pram.render_step(r, 2)
    assert "after step 3 of 3 (EREW)" in html and "A[4] read by [0]" in html and ">28<" in html
    assert "initial memory" in pram.render_step(r, -1)
    with pytest.raises(IndexError):
        pram.render_step(r, 3)
    from course_lib.notebook.pram_slider import step_slider

    slider = step_slider(r)
    s, view = slider.widget.children
    assert (s.min, s.max) == (0, 3)  # 0: the initial memory, 3: after the last step
    s.value = 3
    assert "after step 3 of 3" in view.value
    s.value = 0
    assert "initial memory" in view.value
    saved = slider._repr_mimebundle_()  # what a notebook keeps: the widget and every step as HTML
    assert "application/vnd.jupyter.widget-view+json" in saved
    assert "initial memory" in saved["text/html"] and saved["text/html"].count("after step") == 3
    assert "VBox(" not in saved["text/plain"] and "after step 3 of 3" in saved["text/plain"]
    with pytest.raises(ValueError, match="no trace"):
        pram.render_step(run(pram.tree_sum(8), trace=False), 0)


def test_a_2d_array_is_drawn_row_by_row():
    """The ring all-reduce's G[p, N]: row r is rank r's gradient, so the step view has p rows of N."""
    html = pram.render_step(run(allreduce.ring_allreduce(p=4, N=8)), 0)
    rows = re.findall(r"<tr>(.*?)</tr>", html)
    assert [re.search(r"<b>(.*?)</b>", r).group(1) for r in rows] == ["G[0]", "G[1]", "G[2]", "G[3]"]
    assert [r.count("title=") for r in rows] == [8] * 4 and "title='G[2, 5]" in rows[2]
    empty = pram.render_step(run(pram.Program("empty", lambda pid, step, mem: None, 1, {"A": [1], "E": []}, 1,
                                              "EREW")), 0)
    assert "<b>E</b></td></tr>" in empty and "<b>A</b>" in empty  # an empty array keeps its row


def test_long_processor_lists_are_shortened_in_messages():
    assert (pram.models.format_processors(list(range(64)))
            == "0, 1, 2, 3, 4, ... and 63 (64 processors)")
    assert pram.models.format_processors([9, 4]) == "4 and 9"


def test_the_package_docstring_example_runs():
    example = pram.__doc__.split("Modules:")[0].split("\n", 2)[2]   # the indented block
    code = "\n".join(line[4:] for line in example.splitlines() if "step_slider" not in line)
    scope = {}
    exec(code.replace("r.steps, r.work", "out = r.steps, r.work"), scope)
    assert scope["out"] == (3, 7, 31)
