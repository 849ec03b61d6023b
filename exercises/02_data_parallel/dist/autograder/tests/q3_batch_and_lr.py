from otter.test_files import test_case

OK_FORMAT = False

name = "q3_batch_and_lr"
points = 3

@test_case(points=None, hidden=False)
def test_nanogpt_and_goyal(global_batch_size, scaled_lr):
    assert global_batch_size(12, 5, 8) == 480
    assert abs(scaled_lr(0.1, 256, 8192, 'linear') - 3.2) < 1e-12

@test_case(points=None, hidden=True)
def test_sqrt_rule_and_bad_rule(global_batch_size, scaled_lr):
    import math
    assert global_batch_size(64, 1, 1) == 64 and global_batch_size(3, 7, 5) == 105
    assert abs(scaled_lr(0.1, 256, 8192, 'sqrt') - 0.1 * math.sqrt(32)) < 1e-12
    assert abs(scaled_lr(0.0006, 480, 120, 'linear') - 0.00015) < 1e-15
    try:
        scaled_lr(0.1, 256, 512, 'cubic')
    except ValueError as e:
        assert 'linear' in str(e) and 'sqrt' in str(e), 'the error should name the allowed rules'
    else:
        raise AssertionError('an unknown rule must raise ValueError')

