from otter.test_files import test_case

OK_FORMAT = False

name = "q3_resume"
points = [1]

@test_case(points=None, hidden=False)
def test_resume_equals_uninterrupted(uninterrupted, interrupted):
    assert isinstance(interrupted, list) and len(interrupted) == 8, f'expected interrupted to hold 3 + 5 losses, found {(len(interrupted) if isinstance(interrupted, list) else type(interrupted).__name__)}'
    first = next((i for i, (a, b) in enumerate(zip(interrupted, uninterrupted)) if a != b), None)
    assert first is None, f"expected the resumed run's losses to equal the uninterrupted run's, found a difference from iteration {first} on (is the RNG state saved and restored?)"

