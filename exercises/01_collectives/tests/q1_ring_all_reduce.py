from otter.test_files import test_case

OK_FORMAT = False

name = "q1_ring_all_reduce"
points = [1]

@test_case(points=None, hidden=False)
def test_two_ranks(ring_all_reduce):
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)

    def worker(rank, world_size):
        import torch
        import torch.distributed as dist
        torch.manual_seed(10 + rank)
        x = torch.randn(12, dtype=torch.float64)
        expected = x.clone()
        dist.all_reduce(expected)
        with grading.p2p_only(ring_all_reduce):
            out = ring_all_reduce(x)
        return (out is x, x, expected)
    for rank, (same, got, want) in enumerate(grading.run_ranks(worker, 2)):
        assert same, f'rank {rank}: ring_all_reduce must return the tensor it was given (reduced in place), found another object'
        grading.assert_close(got, want, f'rank {rank}: the sum over 2 ranks', atol=1e-12, factors={'the world size': 2})

