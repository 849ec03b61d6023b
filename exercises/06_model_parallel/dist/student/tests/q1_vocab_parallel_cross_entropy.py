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

