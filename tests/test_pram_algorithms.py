"""The classic PRAM algorithms against their textbook counts.

Sources: J. JaJa, An Introduction to Parallel Algorithms (1992): balanced-tree sum (sec. 2.1),
constant-time maximum on common CRCW with n^2 processors (sec. 2.6.1), matrix product on CREW
with n^3 processors in O(log n) (sec. 1.3); W. D. Hillis & G. L. Steele, "Data parallel
algorithms", CACM 29(12), 1986 (scan: log2 n steps, sum_d (n - 2^(d-1)) additions);
G. E. Blelloch, "Prefix sums and their applications", CMU-CS-90-190, 1990 (work-efficient scan:
2(n-1) additions, n-1 swaps); Cook, Dwork & Reischuk, SIAM J. Comput. 15(1), 1986 (OR needs
Omega(log n) steps on CREW).
"""

import itertools

import pytest

from course_lib import pram
from course_lib.pram import AccessViolation, run


def _ok(program, model=None, **kw):
    result = run(program, model, **kw)
    assert program.verify(result) == []
    return result


@pytest.mark.parametrize("n, steps, additions", [(8, 3, 7), (1024, 10, 1023)])
def test_tree_sum_log_steps_and_n_minus_1_additions(n, steps, additions):
    r = _ok(pram.tree_sum(n, seed=n))
    assert (r.steps, r.ops, r.work, r.processors) == (steps, {"add": additions}, additions, n // 2)
    assert r.model == "EREW"


def test_tree_sum_result_and_the_trivial_case():
    assert run(pram.tree_sum(8, values=[3, 1, 4, 1, 5, 9, 2, 6]))["A"][0] == 31
    r = _ok(pram.tree_sum(1, values=[7]))
    assert (r.steps, r.work) == (0, 0)


@pytest.mark.parametrize("n, steps, additions", [(8, 3, 17), (1024, 10, 9217)])
def test_hillis_steele_counts(n, steps, additions):
    r = _ok(pram.prefix_hillis_steele(n, seed=1), "CREW")
    assert additions == sum(n - 2 ** (d - 1) for d in range(1, steps + 1))  # the formula
    assert (r.steps, r.ops, r.processors) == (steps, {"add": additions}, n)


def test_hillis_steele_needs_concurrent_reads():
    msg = r"^EREW: processors 1 and 2 read address 1 at step 0 \(A\[1\]\)"
    with pytest.raises(AccessViolation, match=msg):
        run(pram.prefix_hillis_steele(8), "EREW")
    r = run(pram.prefix_hillis_steele(8, values=[1] * 8))
    assert r["A"] == list(range(1, 9))


@pytest.mark.parametrize("n", [2, 8, 1024])
def test_blelloch_is_work_efficient_and_erew(n):
    r = _ok(pram.prefix_blelloch(n, seed=2), "EREW")
    log_n = n.bit_length() - 1
    assert r.ops == {"add": 2 * (n - 1), "swap": n - 1, "clear": 1}
    assert r.steps == 2 * log_n + 1 and r.processors == n // 2


def test_blelloch_gives_the_exclusive_scan():
    values = [3, 1, 7, 0, 4, 1, 6, 3]  # the example of Blelloch 1990, fig. 1.6
    assert run(pram.prefix_blelloch(8, values=values))["A"] == [0, 3, 4, 11, 11, 15, 16, 22]


@pytest.mark.parametrize("n", [8, 13])
def test_max_in_three_steps_with_n_squared_processors_on_common_crcw(n):
    r = _ok(pram.max_crcw(n, seed=3), "CRCW-common")
    assert (r.steps, r.processors) == (3, n * n)
    assert r.ops["compare"] == n * n
    assert r.max_writers.count > 1  # concurrent writes happened and the common rule held


def test_max_crcw_with_ties_and_on_weaker_models():
    r = _ok(pram.max_crcw(4, values=[5, 9, 9, 1]), "CRCW-common")
    # M[3] (value 1) is cleared by the 3 processors comparing it with 5, 9 and 9
    assert r["R"] == [9] and (r.max_writers.location, r.max_writers.count) == ("M[3]", 3)
    with pytest.raises(AccessViolation, match=r"^CREW: processors .* wrote address \d+ at step 1"):
        run(pram.max_crcw(8), "CREW")
    with pytest.raises(AccessViolation, match=r"^EREW: processors .* read address 0 at step 1"):
        run(pram.max_crcw(8), "EREW")


@pytest.mark.parametrize("model", ["EREW", "CREW"])
@pytest.mark.parametrize("n", [8, 1024])
def test_max_on_erew_and_crew_in_log_n_steps(model, n):
    r = _ok(pram.tree_max(n, seed=4), model)
    assert (r.steps, r.ops) == (n.bit_length() - 1, {"max": n - 1})


def test_or_in_one_step_on_crcw_and_log_n_on_crew():
    bits = [0, 1, 1, 0, 1, 0, 0, 1]
    r = _ok(pram.or_crcw(8, bits=bits), "CRCW-common")
    assert (r.steps, r["R"]) == (1, [1])
    assert r.max_writers.count == 4
    assert _ok(pram.or_crcw(8, bits=[0] * 8), "CRCW-common")["R"] == [0]
    with pytest.raises(AccessViolation, match=r"^CREW: processors 1, 2, 4 and 7 wrote address 8 "
                                              r"at step 0 \(R\[0\]\)"):
        run(pram.or_crcw(8, bits=bits), "CREW")
    # the O(1) program happens to run on CREW when only one bit is set: access depends on data
    assert _ok(pram.or_crcw(8, bits=[0, 0, 0, 1, 0, 0, 0, 0]), "CREW")["R"] == [1]
    for n in (8, 1024):
        r = _ok(pram.or_tree(n, seed=5), "CREW")
        assert r.steps == n.bit_length() - 1


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_matmul_on_crew_with_n_cubed_processors_in_1_plus_log_n_steps(n):
    r = _ok(pram.matmul(n, seed=6), "CREW")
    assert (r.steps, r.processors) == (1 + n.bit_length() - 1, n ** 3)
    assert r.ops == ({"mul": 1} if n == 1 else {"mul": n ** 3, "add": n * n * (n - 1)})


def test_matmul_result_and_erew_violation():
    prog = pram.matmul(4, seed=7)
    r = run(prog)
    A, B = r["A"], r["B"]
    assert r["C"] == [[sum(A[i][k] * B[k][j] for k in range(4)) for j in range(4)]
                      for i in range(4)]
    with pytest.raises(AccessViolation, match=r"^EREW: processors 0, 4, 8 and 12 read address 0 "
                                              r"at step 0 \(A\[0, 0\]\)"):
        run(prog, "EREW")


@pytest.mark.parametrize("n", [8, 1024])
def test_broadcast_constant_on_crew_and_log_n_on_erew(n):
    r = _ok(pram.broadcast_crew(n), "CREW")
    assert (r.steps, r.ops) == (1, {"copy": n - 1})
    r = _ok(pram.broadcast_erew(n), "EREW")
    assert (r.steps, r.ops) == (n.bit_length() - 1, {"copy": n - 1})
    with pytest.raises(AccessViolation, match=r"^EREW: processors 1, 2, 3, 4, 5, \.\.\. and "
                                              rf"{n - 1} \({n - 1} processors\) read address 0"):
        run(pram.broadcast_crew(n), "EREW")


@pytest.mark.parametrize("name", ["tree-sum", "tree-max", "or-tree", "prefix-hillis-steele",
                                  "prefix-blelloch", "matmul", "broadcast-erew"])
def test_n_must_be_a_power_of_two_where_the_algorithm_needs_it(name):
    algo = pram.get_algorithm(name)
    assert algo.power_of_two
    with pytest.raises(ValueError, match=rf"^{name} needs n to be a power of two, got n=12; "
                                         "try n=8 or n=16"):
        algo.build(12)
    with pytest.raises(ValueError, match="n must be a positive integer, got 0"):
        algo.build(0)
    for bad in (8.0, "8"):  # tree-sum and tree-max once drew their numbers first: a TypeError from range()
        with pytest.raises(ValueError, match=rf"^{name}: n must be a positive integer, got {bad!r}"):
            algo.build(bad)


def test_matmul_past_the_processor_cap_is_refused_before_its_memory_is_built():
    """n^3 processors and n^3 cells: n = 1024 is a billion of each (it ran out of time and memory)."""
    with pytest.raises(pram.ProcessorLimitError, match=r"matmul needs n\^3 = 1,073,741,824 processors, more "
                                                       r"than the 1,048,576 allowed"):
        pram.matmul(1024)
    assert pram.matmul(128, max_processors=128 ** 3).processors == 128 ** 3  # the cap raised on purpose


def test_bad_sizes_and_memory_are_named():
    with pytest.raises(ValueError, match="dim must be one of B, T, C, NH, V"):
        pram.growth("X", 1, 2)
    with pytest.raises(ValueError, match=r"memory must be a dict of named arrays, such as \{'A'"):
        run(lambda pid, step, mem: None, processors=2, memory=[0, 0], steps=1)


def test_algorithms_without_the_power_of_two_restriction():
    for name in ("max-crcw", "or-crcw", "broadcast-crew"):
        algo = pram.get_algorithm(name)
        assert not algo.power_of_two
        assert _ok(algo.build(6)).processors == algo.processors(6)


def test_every_registered_algorithm_runs_on_its_model_and_fails_below_it():
    order = list(pram.MODEL_ORDER)
    for name, algo in pram.ALGORITHMS.items():
        prog = algo.build(8)
        assert prog.model == algo.model and prog.processors == algo.processors(8)
        _ok(prog)
        for weaker in itertools.takewhile(lambda m: m != algo.model, order):
            with pytest.raises(AccessViolation):
                run(prog, weaker)


def test_unknown_algorithm():
    assert pram.get_algorithm("tree_sum") is pram.ALGORITHMS["tree-sum"]
    with pytest.raises(ValueError, match="unknown PRAM algorithm 'bogo-sort'; choose one of: "
                                         "tree-sum, "):
        pram.get_algorithm("bogo-sort")


def test_work_time_table_compares_the_two_scans():
    rows = pram.work_time_table([run(pram.prefix_hillis_steele(16)),
                                 run(pram.prefix_blelloch(16))]).splitlines()
    assert rows[0].split()[:5] == ["program", "model", "steps", "work", "processors"]
    assert rows[2].split() == ["prefix-hillis-steele", "CREW", "4", "49", "16", "64"]
    assert rows[3].split() == ["prefix-blelloch", "EREW", "9", "46", "8", "72"]
