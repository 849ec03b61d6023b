from otter.test_files import test_case

OK_FORMAT = False

name = "q3_resume"
points = 4

@test_case(points=None, hidden=False)
def test_resume_equals_uninterrupted(uninterrupted, interrupted):
    assert isinstance(interrupted, list) and len(interrupted) == 8, 'interrupted: 3 + 5 losses'
    assert uninterrupted == interrupted, "the resumed run's losses differ from the uninterrupted run's"

