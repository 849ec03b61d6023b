from otter.test_files import test_case

OK_FORMAT = False

name = "q1_vocab_parallel_cross_entropy"
points = [1]

@test_case(points=None, hidden=False)
def test_two_ranks(vocab_parallel_cross_entropy):
    import torch
    import torch.nn.functional as F
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 12, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 12, (10,), generator=g)
    expected = F.cross_entropy(logits, targets).item()

    def worker(rank, world_size):
        import course_lib.parallel.tensor.vocab as reference
        grading._disable([reference.vocab_parallel_cross_entropy, reference._VocabParallelCrossEntropy.forward])
        loss = vocab_parallel_cross_entropy(logits[:, 6 * rank:6 * (rank + 1)].clone(), targets, 6 * rank)
        return float(grading.returned(loss, f'vocab_parallel_cross_entropy(logits shard, targets, {6 * rank})'))
    for rank, found in enumerate(grading.run_ranks(worker, 2)):
        grading.assert_number(found, expected, f"rank {rank}'s loss (F.cross_entropy of the full logits, 2 ranks)", rel=1e-09, factors={'the world size': 2})

