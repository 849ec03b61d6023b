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

