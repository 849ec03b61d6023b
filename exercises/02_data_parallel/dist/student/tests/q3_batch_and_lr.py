from otter.test_files import test_case

OK_FORMAT = False

name = "q3_batch_and_lr"
points = 3

@test_case(points=None, hidden=False)
def test_nanogpt_and_goyal(global_batch_size, scaled_lr):
    assert global_batch_size(12, 5, 8) == 480
    assert abs(scaled_lr(0.1, 256, 8192, 'linear') - 3.2) < 1e-12

