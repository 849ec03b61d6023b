from otter.test_files import test_case

OK_FORMAT = False

name = "q3_batch_and_lr"
points = [0.5]

@test_case(points=None, hidden=False)
def test_nanogpt_and_goyal(global_batch_size, scaled_lr):
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)

    def check():
        grading.assert_number(global_batch_size(12, 5, 8), 480, 'global_batch_size(12, 5, 8)')
        grading.assert_number(scaled_lr(0.1, 256, 8192, 'linear'), 3.2, 'linear rule')
    grading.isolated(check)

