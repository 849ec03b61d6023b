from otter.test_files import test_case

OK_FORMAT = False

name = "q1_ring_all_reduce"
points = 5

@test_case(points=None, hidden=False)
def test_two_ranks(ring_all_reduce):
    from course_lib.exercises.grading import run_ranks, p2p_only

    def worker(rank, world_size):
        import torch
        import torch.distributed as dist
        torch.manual_seed(10 + rank)
        x = torch.randn(12, dtype=torch.float64)
        expected = x.clone()
        dist.all_reduce(expected)
        with p2p_only():
            out = ring_all_reduce(x)
        return (out is x, (x - expected).abs().max().item())
    for rank, (same, err) in enumerate(run_ranks(worker, 2)):
        assert same, 'ring_all_reduce must return the tensor it was given (reduced in place)'
        assert err < 1e-12, f'rank {rank}: differs from dist.all_reduce by {err}'

