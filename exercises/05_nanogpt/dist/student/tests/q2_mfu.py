from otter.test_files import test_case

OK_FORMAT = False

name = "q2_mfu"
points = 3

@test_case(points=None, hidden=False)
def test_a100_run(mfu_from_metrics):
    import pandas as pd
    run = dict(hardware='a100-40gb', dtype='bfloat16', world_size=8, batch_size=12, block_size=1024, gradient_accumulation_steps=5, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    metrics = pd.DataFrame({'iter': [0, 10, 20, 30, 40, 50], 'step_ms': [5210.0, 171.2, 169.8, 170.4, 175.9, 170.1]})
    want = 855383040 * 491520 / 0.1704 / (8 * 312000000000000.0)
    got = mfu_from_metrics(metrics, run)
    assert abs(got - want) < 1e-09, f'MFU {got!r}, expected {want!r}'

