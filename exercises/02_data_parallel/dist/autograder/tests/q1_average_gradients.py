from otter.test_files import test_case

OK_FORMAT = False

name = "q1_average_gradients"
points = 4

@test_case(points=None, hidden=False)
def test_two_ranks_equal_whole_batch(average_gradients):
    import torch
    from course_lib.exercises.grading import assert_close, run_ranks

    def make_model():
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    g = torch.Generator().manual_seed(6)
    X, Y = (torch.randn(10, 3, generator=g), torch.randn(10, 2, generator=g))

    def worker(rank, world_size):
        model = make_model()
        torch.nn.functional.mse_loss(model(X.chunk(world_size)[rank]), Y.chunk(world_size)[rank]).backward()
        average_gradients(model)
        return [p.grad for p in model.parameters()]
    model = make_model()
    torch.nn.functional.mse_loss(model(X), Y).backward()
    for rank, grads in enumerate(run_ranks(worker, 2)):
        assert_close(grads, [p.grad for p in model.parameters()], f"rank {rank}'s averaged gradients")

@test_case(points=None, hidden=True)
def test_three_ranks_gpt_with_frozen_and_tied_weights(average_gradients):
    import torch
    from course_lib.exercises.grading import assert_close, run_ranks
    from course_lib.gpt.model import GPT, GPTConfig
    cfg = GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8)
    g = torch.Generator().manual_seed(7)
    idx, targets = (torch.randint(0, 16, (6, 8), generator=g), torch.randint(0, 16, (6, 8), generator=g))

    def make_model():
        torch.manual_seed(8)
        model = GPT(cfg)
        model.transformer.wpe.weight.requires_grad_(False)
        return model

    def worker(rank, world_size):
        model = make_model()
        _, loss = model(idx.chunk(world_size)[rank], targets.chunk(world_size)[rank])
        loss.backward()
        average_gradients(model)
        return [p.grad for p in model.parameters()]
    model = make_model()
    model(idx, targets)[1].backward()
    for rank, grads in enumerate(run_ranks(worker, 3)):
        assert grads[1] is None, "a frozen parameter's grad must stay None"
        assert_close([x for x in grads if x is not None], [p.grad for p in model.parameters() if p.grad is not None], f"rank {rank}'s averaged GPT gradients (3 ranks)")

