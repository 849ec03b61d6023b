from otter.test_files import test_case

OK_FORMAT = False

name = "q1_flops_per_token"
points = [0.5]

@test_case(points=None, hidden=False)
def test_gpt2_small(flops_per_token):
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)

    def check():
        from course_lib.gpt.model import GPTConfig
        cfg = GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
        grading.assert_number(flops_per_token(cfg), 6 * 123689472 + 12 * 12 * 768 * 1024, 'GPT-2 small FLOPs per token', hint='6N with N without the position embedding, plus 12 n_layer n_embd T')
    grading.isolated(check)

