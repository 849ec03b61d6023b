from otter.test_files import test_case

OK_FORMAT = False

name = "q2_one_f_one_b"
points = 3

@test_case(points=None, hidden=False)
def test_three_stages(one_f_one_b, max_in_flight):
    assert one_f_one_b(4, 0, 3) == [('F', 0), ('F', 1), ('F', 2), ('B', 0), ('F', 3), ('B', 1), ('B', 2), ('B', 3)]
    assert max_in_flight(one_f_one_b(4, 0, 3)) == 3

