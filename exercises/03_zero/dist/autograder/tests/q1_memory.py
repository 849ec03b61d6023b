from otter.test_files import test_case

OK_FORMAT = False

name = "q1_memory"
points = 3

@test_case(points=None, hidden=False)
def test_figure_1(model_state_gb):
    paper = [120, 31.4, 16.6, 1.9]
    for stage, want in enumerate(paper):
        got = model_state_gb(7500000000.0, 64, stage)
        assert abs(got - want) < 0.05, f'stage {stage}: {got} GB, the paper shows {want} GB'

@test_case(points=None, hidden=True)
def test_against_memory_model(model_state_gb):
    from course_lib.analysis.memory import GB, model_state_bytes
    for psi, n_d, k in [(1500000000.0, 4, 12), (128000000000.0, 1024, 12), (1000000000000.0, 1024, 12), (300000000.0, 7, 8), (7500000000.0, 1, 12)]:
        for stage in range(4):
            want = model_state_bytes(psi, n_d, stage, k=k).total / GB
            got = model_state_gb(psi, n_d, stage, k=k)
            assert abs(got - want) <= 1e-09 * want, f'psi={psi:g} N_d={n_d} K={k} stage {stage}: {got} != {want}'
    assert abs(model_state_gb(1000000000000.0, 1024, 3) - 15.625) < 1e-09

