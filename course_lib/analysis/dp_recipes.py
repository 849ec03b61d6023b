"""The arithmetic of data-parallel training: the global batch, learning-rate scaling, data per rank.

Global batch. Each of the N = dp_world_size ranks runs ``grad_accum`` micro-batches of
``micro_batch`` sequences before the gradients are averaged, so one optimizer step sees

    global batch = micro_batch x grad_accum x dp_world_size      sequences (x block_size tokens)

Learning rate. When the global batch grows k-fold, from B0 to B = k B0, two rules keep training
comparable (``scale_lr``):

* linear: lr = k lr0. Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in
  1 Hour" (arXiv:1706.02677), Sec. 2.1: k times larger batches average k times more gradients,
  so one step should go as far as k small steps would; they set lr = 0.1 x B / 256 for ResNet-50
  up to B = 8192 (lr 3.2), with a gradual warmup over the first 5 epochs (Sec. 2.2).
* sqrt: lr = sqrt(k) lr0. Krizhevsky 2014, "One weird trick for parallelizing convolutional
  neural networks" (arXiv:1404.5997), gives the theory in its discussion of the learning rate
  for larger batches: multiplying the batch by k divides the variance of the gradient estimate
  by k, and sqrt(k) keeps the variance of the step constant. His own experiments there found
  the linear rule worked best in practice, so he credits sqrt(k) to theory and lr x k to
  experience. Hoffer, Hubara and Soudry 2017, "Train
  longer, generalize better" (arXiv:1705.08741), Sec. 4, use sqrt(k) to close part of the gap
  in generalisation of large batches.

Unique data per rank (``rank_samples``). N ranks that compute gradients on the same samples
waste N - 1 of their work. Three ways to give each its own:

* ``shard``: every rank reads a disjoint 1/N of one shuffled permutation (PyTorch's
  DistributedSampler); no sample is seen twice within an epoch.
* ``seed``: every rank samples the whole dataset with its own seed (base seed + rank, as
  nanoGPT's ``seed_offset``); duplicates happen only by chance, with probability
  1 - (1 - 1/n)^k for a given draw when the other rank drew k of n samples (``expected_overlap``).
* ``global_slice``: every rank draws the *global* batch with the same seed and keeps its own
  slice (course_lib.gpt.data.TrainBatches): the same samples as one process with the whole batch.

``same_seed`` is the bug the other three avoid: every rank draws the same samples.
"""

from __future__ import annotations

import math

from course_lib.utils import check_count

RULES = ("linear", "sqrt")
METHODS = ("shard", "seed", "global_slice", "same_seed")


def global_batch_size(micro_batch: int, grad_accum: int = 1, dp_world_size: int = 1) -> int:
    """Sequences per optimizer step: micro_batch x grad_accum x dp_world_size."""
    return (check_count("micro_batch", micro_batch) * check_count("grad_accum", grad_accum)
            * check_count("dp_world_size", dp_world_size))


def grad_accum_for(global_batch: int, micro_batch: int, dp_world_size: int) -> int:
    """The accumulation steps that give ``global_batch`` with this micro-batch and rank count."""
    per_step = check_count("micro_batch", micro_batch) * check_count("dp_world_size", dp_world_size)
    check_count("global_batch", global_batch)
    if global_batch % per_step:
        raise ValueError(f"a global batch of {global_batch} cannot be made of micro-batches of {micro_batch} "
                         f"on {dp_world_size} ranks ({per_step} per accumulation step); pick a micro-batch "
                         f"or rank count whose product divides {global_batch}")
    return global_batch // per_step


def batch_plans(global_batch: int, micro_batches, world_sizes) -> list[dict]:
    """Every (ranks, micro_batch, grad_accum) that gives ``global_batch``: one row each."""
    rows = []
    for n in world_sizes:
        for b in micro_batches:
            if global_batch % (b * n) == 0:
                rows.append({"ranks": n, "micro_batch": b, "grad_accum": grad_accum_for(global_batch, b, n),
                             "global_batch": global_batch})
    return rows


def scale_lr(base_lr: float, base_batch: int, batch: int, rule: str = "linear") -> float:
    """The learning rate for ``batch`` when ``base_lr`` worked for ``base_batch`` (module docstring)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if not base_lr > 0:
        raise ValueError(f"base_lr must be > 0, got {base_lr!r}")
    k = check_count("batch", batch) / check_count("base_batch", base_batch)
    return base_lr * (k if rule == "linear" else math.sqrt(k))


def rank_samples(method: str, n_samples: int, n_draws: int, rank: int, dp_world_size: int,
                 seed: int = 0):
    """The ``n_draws`` sample indices (a LongTensor) that ``rank`` reads under ``method``."""
    import torch  # here: analysis/ is torch-free arithmetic (the trainer's configuration reads it); only this draws
    from torch.utils.data import DistributedSampler

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    n_samples, n_draws = check_count("n_samples", n_samples), check_count("n_draws", n_draws)
    dp_world_size = check_count("dp_world_size", dp_world_size)
    if not 0 <= rank < dp_world_size:
        raise ValueError(f"rank must be in 0..{dp_world_size - 1}, got {rank!r}")
    if method == "shard":
        if n_draws > n_samples // dp_world_size:
            raise ValueError(f"one epoch of {n_samples} samples gives each of {dp_world_size} ranks "
                             f"{n_samples // dp_world_size}; ask for at most that many draws")
        sampler = DistributedSampler(range(n_samples), num_replicas=dp_world_size, rank=rank,
                                     shuffle=True, seed=seed, drop_last=True)
        return torch.tensor(list(sampler)[:n_draws])
    if method == "global_slice":
        g = torch.Generator().manual_seed(seed)
        return torch.randint(n_samples, (dp_world_size, n_draws), generator=g)[rank]
    g = torch.Generator().manual_seed(seed + (rank if method == "seed" else 0))
    return torch.randint(n_samples, (n_draws,), generator=g)


def duplicate_fraction(reference, other) -> float:
    """Fraction of ``other``'s draws whose sample also occurs among ``reference``'s draws."""
    import torch  # here: analysis/ is torch-free arithmetic (the trainer's configuration reads it)

    other = torch.as_tensor(other)
    if other.numel() == 0:
        raise ValueError("other holds no draws")
    return torch.isin(other, torch.as_tensor(reference)).float().mean().item()


def expected_overlap(n_samples: int, n_draws: int) -> float:
    """Chance that one uniform draw hits a sample among ``n_draws`` independent uniform draws of
    another rank: 1 - (1 - 1/n)^k."""
    n_samples, n_draws = check_count("n_samples", n_samples), check_count("n_draws", n_draws)
    return 1.0 - (1.0 - 1.0 / n_samples) ** n_draws


def overlap_table(n_samples: int, n_draws: int, dp_world_size: int = 2, seed: int = 0) -> list[dict]:
    """For each method: how many of rank 1's draws rank 0 also read, and the expectation."""
    if dp_world_size < 2:
        raise ValueError("overlap between ranks needs dp_world_size >= 2")
    rows = []
    for method in METHODS:
        r0 = rank_samples(method, n_samples, n_draws, 0, dp_world_size, seed)
        r1 = rank_samples(method, n_samples, n_draws, 1, dp_world_size, seed)
        expected = {"shard": 0.0, "same_seed": 1.0}.get(method, expected_overlap(n_samples, n_draws))
        rows.append({"method": method, "rank 0 reads": r0[:6].tolist(), "rank 1 reads": r1[:6].tolist(),
                     "shared with rank 0": duplicate_fraction(r0, r1), "expected": expected})
    return rows
