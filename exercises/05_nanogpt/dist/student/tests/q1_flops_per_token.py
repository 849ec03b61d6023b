from otter.test_files import test_case

OK_FORMAT = False

name = "q1_flops_per_token"
points = 2

@test_case(points=None, hidden=False)
def test_gpt2_small(flops_per_token):
    from course_lib.gpt.model import GPTConfig
    cfg = GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    assert flops_per_token(cfg) == 6 * 123689472 + 12 * 12 * 768 * 1024

