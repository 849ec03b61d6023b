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

@test_case(points=None, hidden=True)
def test_t4_fp16_single_gpu(mfu_from_metrics):
    import pandas as pd
    import torch
    from course_lib.hardware import PROFILES
    from course_lib.gpt.model import GPT, GPTConfig
    run = dict(hardware='t4', dtype='float16', world_size=1, batch_size=64, block_size=256, gradient_accumulation_steps=1, vocab_size=65, n_layer=6, n_head=6, n_embd=384)
    metrics = pd.DataFrame({'iter': [0, 5, 10, 15, 20], 'step_ms': [900.0, 310.0, 290.0, 305.0, 2000.0]})
    cfg = GPTConfig(block_size=256, vocab_size=65, n_layer=6, n_head=6, n_embd=384)
    with torch.device('meta'):
        model = GPT(cfg)
    want = model.estimate_mfu(64 * 256 / 0.3075, PROFILES['t4'].peak('float16'))
    got = mfu_from_metrics(metrics, run)
    assert abs(got - want) < 1e-09 * want, f'MFU {got!r}, expected {want!r}'

@test_case(points=None, hidden=True)
def test_world_size_and_dtype(mfu_from_metrics):
    import pandas as pd
    from course_lib.hardware import PROFILES
    base = dict(hardware='h100', dtype='bfloat16', world_size=1, batch_size=8, block_size=512, gradient_accumulation_steps=4, vocab_size=50304, n_layer=4, n_head=4, n_embd=256)
    metrics = pd.DataFrame({'iter': [0, 1, 2], 'step_ms': [50.0, 20.0, 20.0]})
    one = mfu_from_metrics(metrics, base)
    assert abs(mfu_from_metrics(metrics, {**base, 'world_size': 2}) - one) < 1e-12
    ratio = PROFILES['h100'].peak('bfloat16') / PROFILES['h100'].peak('tf32')
    assert abs(mfu_from_metrics(metrics, {**base, 'dtype': 'tf32'}) - ratio * one) < 1e-09 * one

