from otter.test_files import test_case

OK_FORMAT = False

name = "q2_zero1_step"
points = 5

@test_case(points=None, hidden=False)
def test_two_ranks_match_adamw(Zero1AdamW):
    import torch
    from course_lib.exercises.grading import assert_close, run_ranks

    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))

    def data():
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)) for _ in range(3)]

    def worker(rank, world_size):
        model = make_model()
        opt = Zero1AdamW(model.parameters(), lr=0.01)
        for x, y in data():
            loss = torch.nn.functional.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach() for p in model.parameters()]
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    for x, y in data():
        loss = torch.nn.functional.mse_loss(model(x), y)
        ref.zero_grad()
        loss.backward()
        ref.step()
    for rank, params in enumerate(run_ranks(worker, 2)):
        assert_close(params, list(model.parameters()), f"rank {rank}'s parameters after 3 ZeRO-1 steps vs AdamW")

@test_case(points=None, hidden=True)
def test_three_ranks_padding_and_sharded_state(Zero1AdamW):
    import torch
    from course_lib.exercises.grading import assert_close, run_ranks

    def make_model():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.GELU(), torch.nn.Linear(5, 2))

    def data():
        g = torch.Generator().manual_seed(4)
        return [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(4)]

    def worker(rank, world_size):
        model = make_model()
        opt = Zero1AdamW(model.parameters(), lr=0.005)
        for x, y in data():
            loss = torch.nn.functional.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
            opt.zero_grad()
            loss.backward()
            opt.step()
        state = sum((t.numel() for s in opt.optimizer.state.values() for t in s.values() if t.dim() > 0))
        return ([p.detach() for p in model.parameters()], state)
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=0.005, betas=(0.9, 0.95), weight_decay=0.1)
    for x, y in data():
        loss = torch.nn.functional.mse_loss(model(x), y)
        ref.zero_grad()
        loss.backward()
        ref.step()
    for rank, (params, state) in enumerate(run_ranks(worker, 3)):
        assert_close(params, list(model.parameters()), f"rank {rank}'s parameters (3 ranks) vs AdamW")
        assert state == 2 * 13, f'rank {rank} holds {state} optimizer-state elements, expected 2 x 13 (its slice)'

