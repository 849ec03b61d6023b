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

