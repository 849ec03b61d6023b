from otter.test_files import test_case

OK_FORMAT = False

name = "q1_fabric_loop"
points = [1]

@test_case(points=None, hidden=False)
def test_ddp_on_two_ranks_equals_one_process(fabric_train):
    import torch
    import torch.nn.functional as F
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)

    def make_model():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def make_optimizer(model):
        return torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(3)]
    model, expected = (make_model(), [])
    opt = make_optimizer(model)
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())

    def worker(rank, world_size):
        from course_lib.experiments.frameworks_fabric import make_fabric
        return fabric_train(make_fabric('ddp'), make_model, make_optimizer, batches)
    for rank, losses in enumerate(grading.run_ranks(worker, 2)):
        assert isinstance(losses, list) and len(losses) == len(expected), f'rank {rank}: expected fabric_train to return a list of {len(expected)} losses, one float per step, found {losses!r}'
        grading.assert_close(torch.tensor(losses), torch.tensor(expected), f"rank {rank}'s losses (one process: the whole batch)")

