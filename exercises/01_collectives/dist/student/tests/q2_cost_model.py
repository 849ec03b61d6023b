from otter.test_files import test_case

OK_FORMAT = False

name = "q2_cost_model"
points = 3

@test_case(points=None, hidden=False)
def test_congestion_example(congestion):
    assert abs(congestion['naive_reduce_s'] - 0.4) < 1e-12
    assert abs(congestion['ring_all_reduce_s'] - 0.16) < 1e-12

