from otter.test_files import test_case

OK_FORMAT = False

name = "q3_resume"
points = 4

@test_case(points=None, hidden=False)
def test_resume_equals_uninterrupted(uninterrupted, interrupted):
    assert isinstance(interrupted, list) and len(interrupted) == 8, 'interrupted: 3 + 5 losses'
    assert uninterrupted == interrupted, "the resumed run's losses differ from the uninterrupted run's"

@test_case(points=None, hidden=True)
def test_checkpoint_is_safe_and_complete(train, save_checkpoint):
    import os, tempfile
    import torch
    d = tempfile.mkdtemp()
    path = os.path.join(d, 'ckpt.pt')
    train(2, path)
    state = torch.load(path, weights_only=True)
    assert isinstance(state, dict)
    assert sorted(os.listdir(d)) == ['ckpt.pt'], f'left behind: {sorted(os.listdir(d))}'

@test_case(points=None, hidden=True)
def test_resume_twice_elsewhere(train):
    import os, tempfile
    d = tempfile.mkdtemp()
    full = train(7, os.path.join(d, 'full.pt'))
    p = os.path.join(d, 'parts.pt')
    parts = train(7, p, stop_after=1)
    parts += train(7, p, resume=True, stop_after=5)
    parts += train(7, p, resume=True)
    assert parts == full, 'crashing after iterations 1 and 5 and resuming must not change the losses'

