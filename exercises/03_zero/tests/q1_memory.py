from otter.test_files import test_case

OK_FORMAT = False

name = "q1_memory"
points = [0.5]

@test_case(points=None, hidden=False)
def test_figure_1(model_state_gb):
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)

    def check():
        for stage, want in enumerate([120, 31.4, 16.6, 1.9]):
            grading.assert_number(model_state_gb(7500000000.0, 64, stage), want, f"stage {stage} (the paper's Figure 1)", rel=0.0, abs_tol=0.05, factors={'N_d': 64, '10^9 / 2^30 (GB vs GiB)': 1000000000.0 / 2 ** 30})
    grading.isolated(check)

