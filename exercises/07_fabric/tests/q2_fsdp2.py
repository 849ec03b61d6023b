from otter.test_files import test_case

OK_FORMAT = False

name = "q2_fsdp2"
points = [1]

@test_case(points=None, hidden=False)
def test_fsdp2_on_two_ranks_equals_one_process(parallelize):
    import torch
    import torch.nn.functional as F
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)

    def make_model():
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(3)]
    model, expected = (make_model(), [])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())

    def worker(rank, world_size):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh('cpu', (world_size, 1), mesh_dim_names=('data_parallel', 'tensor_parallel'))
        from torch.distributed.fsdp import FSDPModule
        model = grading.returned(parallelize(make_model(), mesh), 'parallelize(model, mesh)')
        units = [type(m).__name__.replace('FSDP', '', 1) for m in model.modules() if isinstance(m, FSDPModule)]
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        losses = []
        for x, y in batches:
            loss = F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
            opt.zero_grad()
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world_size)
        return (losses, units)
    for rank, (losses, units) in enumerate(grading.run_ranks(worker, 2)):
        assert units == ['Sequential', 'Linear', 'Linear'], f"rank {rank}: expected FSDP units ['Sequential', 'Linear', 'Linear'] (the root, then each Linear), found {units}"
        grading.assert_close(torch.tensor(losses), torch.tensor(expected), f"rank {rank}'s losses under FSDP2 (one process: the whole batch)")

