from otter.test_files import test_case

OK_FORMAT = False

name = "q2_mfu"
points = [0.5]

@test_case(points=None, hidden=False)
def test_a100_run(mfu_from_metrics):
    import pandas as pd
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)
    run = dict(hardware='a100-40gb', dtype='bfloat16', world_size=8, batch_size=12, block_size=1024, gradient_accumulation_steps=5, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    metrics = pd.DataFrame({'iter': [0, 10, 20, 30, 40, 50], 'step_ms': [5210.0, 421.3, 418.9, 420.4, 431.0, 419.7]})
    want = 855383040 * 491520 / 0.4204 / (8 * 312000000000000.0)
    grading.isolated(lambda: grading.assert_number(mfu_from_metrics(metrics, run), want, 'MFU of the A100 run', factors={'the world size': 8, '100 (a percentage?)': 100}), stand_ins={mfu_from_metrics: {'flops_per_token': lambda cfg: 855383040}})

