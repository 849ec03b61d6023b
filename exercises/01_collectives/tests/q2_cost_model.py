from otter.test_files import test_case

OK_FORMAT = False

name = "q2_cost_model"
points = [0.5]

@test_case(points=None, hidden=False)
def test_congestion_example(congestion):
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)
    grading.assert_number(congestion['naive_reduce_s'], 0.4, 'naive_reduce_s', factors={'4 senders': 4})
    grading.assert_number(congestion['ring_all_reduce_s'], 0.16, 'ring_all_reduce_s', factors={'2 (the two phases)': 2, 'p = 5': 5, 'p - 1 = 4': 4})

