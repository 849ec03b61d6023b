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

@test_case(points=None, hidden=True)
def test_three_and_four_ranks_uneven_sizes_and_traffic(ring_all_reduce):
    from course_lib.analysis import comm_cost as comm
    from course_lib.exercises.grading import run_ranks, p2p_only

    def worker(rank, world_size):
        import torch
        import torch.distributed as dist
        torch.manual_seed(100 + rank)
        x = torch.randn(5, 7, dtype=torch.float64)
        expected = x.clone()
        dist.all_reduce(expected)
        with p2p_only() as sent:
            ring_all_reduce(x)
        return ((x - expected).abs().max().item(), sent.bytes)
    nbytes = 35 * 8
    for p in (3, 4):
        results = run_ranks(worker, p)
        ring_bytes = comm.traffic('all_reduce', nbytes, p, 'ring')[0][0]
        for rank, (err, sent) in enumerate(results):
            assert err < 1e-12, f'{p} ranks, rank {rank}: differs from dist.all_reduce by {err}'
            assert abs(sent - ring_bytes) <= 2 * (p - 1) * 8, f'{p} ranks, rank {rank} sent {sent} bytes; a ring sends 2(p-1)/p n = {ring_bytes:.0f}'

