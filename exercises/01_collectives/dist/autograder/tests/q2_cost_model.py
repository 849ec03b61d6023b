from otter.test_files import test_case

OK_FORMAT = False

name = "q2_cost_model"
points = 3

@test_case(points=None, hidden=False)
def test_congestion_example(congestion):
    assert abs(congestion['naive_reduce_s'] - 0.4) < 1e-12
    assert abs(congestion['ring_all_reduce_s'] - 0.16) < 1e-12

@test_case(points=None, hidden=True)
def test_against_cost_model(ring_all_reduce_time, naive_all_reduce_time):
    from course_lib.analysis import comm_cost as comm
    for n, p, bw, alpha in [(1000000000.0, 5, 10000000000.0, 0.0), (4000000.0, 8, 25000000000.0, 5e-06), (123456.0, 3, 1000000000.0, 0.0001), (100000000.0, 64, 100000000000.0, 2e-06)]:
        for mine, algorithm in ((ring_all_reduce_time, 'ring'), (naive_all_reduce_time, 'naive')):
            want = comm.collective_time('all_reduce', n, p, bandwidth=bw, alpha=alpha, algorithm=algorithm)
            got = mine(n, p, bw, alpha)
            assert abs(got - want) <= 1e-12 + 1e-09 * want, f'{algorithm} n={n:g} p={p}: {got} != {want}'

