from otter.test_files import test_case

OK_FORMAT = False

name = "q2_one_f_one_b"
points = 3

@test_case(points=None, hidden=False)
def test_three_stages(one_f_one_b, max_in_flight):
    assert one_f_one_b(4, 0, 3) == [('F', 0), ('F', 1), ('F', 2), ('B', 0), ('F', 3), ('B', 1), ('B', 2), ('B', 3)]
    assert max_in_flight(one_f_one_b(4, 0, 3)) == 3

@test_case(points=None, hidden=True)
def test_against_the_course_pipeline(one_f_one_b, max_in_flight):
    from course_lib.parallel.pipeline_parallel import schedule_ops
    for m in (1, 2, 3, 8):
        for p in (1, 2, 4):
            for r in range(p):
                assert one_f_one_b(m, r, p) == schedule_ops('1f1b', m, r, p), (m, r, p)
                assert max_in_flight(one_f_one_b(m, r, p)) == min(p - r, m), (m, r, p)

