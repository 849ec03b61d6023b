from otter.test_files import test_case

OK_FORMAT = False

name = "q2_zero1_step"
points = [1]

@test_case(points=None, hidden=False)
def test_two_ranks_match_adamw(Zero1AdamW):
    import torch
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)

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
    for rank, params in enumerate(grading.run_ranks(worker, 2)):
        grading.assert_close(params, list(model.parameters()), f"rank {rank}'s parameters after 3 ZeRO-1 steps vs AdamW")

