from otter.test_files import test_case

OK_FORMAT = False

name = "q1_erew_prefix_sum"
points = 4

@test_case(points=None, hidden=False)
def test_small_inputs(erew_prefix_sum):
    import itertools
    from course_lib import pram
    for values in ([3, 1, 4, 1, 5, 9, 2, 6], [7, 7], list(range(16))):
        prog = erew_prefix_sum(values)
        assert isinstance(prog, pram.Program), 'erew_prefix_sum must return a pram.Program'
        r = pram.run(prog, 'EREW')
        want = list(itertools.accumulate(values))
        assert r['A'] == want, f"for {values}: A = {r['A']}, expected {want}"

@test_case(points=None, hidden=True)
def test_large_input_log_steps(erew_prefix_sum):
    import itertools, math, random
    from course_lib import pram
    rng = random.Random(1234)
    for n in (2, 64, 1024):
        values = [rng.randint(-50, 50) for _ in range(n)]
        prog = erew_prefix_sum(values)
        assert prog.processors <= n, f'n={n}: {prog.processors} processors, at most n allowed'
        r = pram.run(prog, 'EREW', trace=False)
        assert r['A'] == list(itertools.accumulate(values)), f'n={n}: wrong prefix sums'
        bound = 2 * math.ceil(math.log2(n)) + 2
        assert r.steps <= bound, f'n={n}: {r.steps} steps, O(log n) means at most {bound}'

