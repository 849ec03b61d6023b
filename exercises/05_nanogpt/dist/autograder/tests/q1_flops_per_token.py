from otter.test_files import test_case

OK_FORMAT = False

name = "q1_flops_per_token"
points = 2

@test_case(points=None, hidden=False)
def test_gpt2_small(flops_per_token):
    from course_lib.gpt.model import GPTConfig
    cfg = GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    assert flops_per_token(cfg) == 6 * 123689472 + 12 * 12 * 768 * 1024

@test_case(points=None, hidden=True)
def test_other_shapes(flops_per_token):
    import torch
    from course_lib.gpt.model import GPT, GPTConfig
    for cfg in (GPTConfig(block_size=256, vocab_size=65, n_layer=6, n_head=6, n_embd=384, bias=False), GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128)):
        with torch.device('meta'):
            want = GPT(cfg).flops_per_token()
        assert flops_per_token(cfg) == want, f'{cfg}: {flops_per_token(cfg)} != {want}'

