from otter.test_files import test_case

OK_FORMAT = False

name = "q1_vocab_parallel_cross_entropy"
points = 5

@test_case(points=None, hidden=False)
def test_two_ranks(vocab_parallel_cross_entropy):
    from course_lib.exercises.grading import run_ranks

    def worker(rank, world_size):
        import torch
        import torch.nn.functional as F
        g = torch.Generator().manual_seed(1)
        logits = torch.randn(10, 12, generator=g, dtype=torch.float64)
        targets = torch.randint(0, 12, (10,), generator=g)
        mine = vocab_parallel_cross_entropy(logits[:, 6 * rank:6 * (rank + 1)].clone(), targets, 6 * rank)
        return abs(float(mine) - F.cross_entropy(logits, targets).item())
    for rank, err in enumerate(run_ranks(worker, 2)):
        assert err < 1e-10, f'rank {rank}: differs from F.cross_entropy by {err}'

@test_case(points=None, hidden=True)
def test_three_ranks_large_logits_and_no_gather(vocab_parallel_cross_entropy):
    from course_lib.exercises.grading import run_ranks

    def worker(rank, world_size):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        g = torch.Generator().manual_seed(2)
        logits = 200 * torch.randn(7, 9, generator=g, dtype=torch.float64)
        targets = torch.randint(0, 9, (7,), generator=g)
        calls = []
        real = dist.all_reduce

        def counting(t, *a, **k):
            calls.append(t.numel())
            return real(t, *a, **k)
        dist.all_reduce = counting
        try:
            mine = vocab_parallel_cross_entropy(logits[:, 3 * rank:3 * (rank + 1)].clone(), targets, 3 * rank)
        finally:
            dist.all_reduce = real
        return (abs(float(mine) - F.cross_entropy(logits, targets).item()), calls)
    for rank, (err, calls) in enumerate(run_ranks(worker, 3)):
        assert err < 1e-08, f'rank {rank}: differs from F.cross_entropy by {err}'
        assert calls == [7, 7, 7], f'rank {rank}: expected three all-reduces of N=7 numbers, got sizes {calls}'

