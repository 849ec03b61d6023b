from otter.test_files import test_case

OK_FORMAT = False

name = "q1_erew_prefix_sum"
points = [1]

@test_case(points=None, hidden=False)
def test_small_inputs(erew_prefix_sum):
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)

    def check():
        import itertools
        from course_lib import pram
        for values in ([3, 1, 4, 1, 5, 9, 2, 6], [7, 7], list(range(16))):
            prog = erew_prefix_sum(values)
            assert isinstance(prog, pram.Program), f'expected a pram.Program, found {type(prog).__name__}'
            r = pram.run(prog, 'EREW')
            want = list(itertools.accumulate(values))
            found = r['A']
            assert found == want, f'for {values}: expected A = {want}, found {found}'
    grading.isolated(check)

