from otter.test_files import test_case

OK_FORMAT = False

name = "q1_fix_the_step"
points = [1]

@test_case(points=None, hidden=False)
def test_two_ranks_take_the_step_of_one_process(dp_step):
    import torch
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)

    def make_model():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    g = torch.Generator().manual_seed(4)
    X, Y = (torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g))

    def worker(rank, world_size):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        dp_step(model, optimizer, X.chunk(world_size)[rank], Y.chunk(world_size)[rank])
        return ([p.grad for p in model.parameters()], [p.detach() for p in model.parameters()])
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(model(X), Y).backward()
    optimizer.step()
    for rank, (grads, params) in enumerate(grading.run_ranks(worker, 2, timeout=20)):
        grading.assert_close(grads, [p.grad for p in model.parameters()], f"rank {rank}'s gradients after the sync", factors={'the world size': 2})
        grading.assert_close(params, [p.detach() for p in model.parameters()], f"rank {rank}'s parameters after the step")

