from otter.test_files import test_case

OK_FORMAT = False

name = "q2_one_f_one_b"
points = [0.5]

@test_case(points=None, hidden=False)
def test_three_stages(one_f_one_b, max_in_flight):
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)
    from course_lib.parallel.pipeline.schedules import schedule_ops

    def check():
        expected = [('F', 0), ('F', 1), ('F', 2), ('B', 0), ('F', 3), ('B', 1), ('B', 2), ('B', 3)]
        found = list(grading.returned(one_f_one_b(4, 0, 3), 'one_f_one_b(4, 0, 3)'))
        assert found == expected, f'one_f_one_b(4, 0, 3): expected {expected}, found {found}'
        grading.assert_number(max_in_flight(expected), 3, 'max_in_flight of stage 0 of 3, 4 micro-batches')
    grading.isolated(check, forbid=[schedule_ops])

