from otter.test_files import test_case

OK_FORMAT = False

name = "q1_average_gradients"
points = [1]

@test_case(points=None, hidden=False)
def test_two_ranks_equal_whole_batch(average_gradients):
    import torch
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)

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
    for rank, grads in enumerate(grading.run_ranks(worker, 2)):
        grading.assert_close(grads, [p.grad for p in model.parameters()], f"rank {rank}'s averaged gradients", factors={'the world size': 2})

