"""Corners of our data parallelism against one process, on 2 gloo ranks (audit of parallel/data).

* A second backward before ``finish_gradient_synchronization`` (without ``no_sync``) brings
  gradients for buckets whose all-reduce is already on its way: the bucketed version must refuse
  it, as PyTorch's DDP does, instead of returning gradients that differ between the ranks.
* 16-bit gradient communication in fp16 (range 65504) must average, not overflow: each rank's
  share is divided before the sum, in both versions (as PyTorch's ``fp16_compress_hook``).
* The corners that already held (a parameter with a gradient on one rank only, one used twice in
  forward, a zero-size one, definition order unlike backward order, three micro-batches under
  ``no_sync``, buckets smaller than one parameter) stay equal to one process.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from course_lib.launch.spawn import run_ranks
from course_lib.parallel.comms import Comms
from course_lib.parallel.data.ddp import DataParallelBucket, DataParallelNaive
from course_lib.parallel.zero.zero3 import FullyShardedDataParallel
from course_lib.parallel.zero.zero12 import ShardedOptimizer


def _twice_rank(rank: int, world_size: int):
    out = {}
    x = torch.arange(12.0).view(4, 3)
    for wrapper in (DataParallelBucket, DataParallelNaive):
        for accumulate in (False, True):  # two backward passes; with no_sync on the first or not
            torch.manual_seed(0)
            model = nn.Linear(3, 1)
            ddp = wrapper(model)
            try:
                for i in range(2):
                    with ddp.no_sync() if accumulate and i == 0 else contextlib.nullcontext():
                        ddp(x[2 * rank + i: 2 * rank + i + 1]).sum().backward()
            except RuntimeError as e:
                out[(wrapper.__name__, accumulate)] = str(e)
            ddp.finish_gradient_synchronization()  # (after a refusal: waits for what was sent)
            if (wrapper.__name__, accumulate) not in out:
                out[(wrapper.__name__, accumulate)] = model.weight.grad
    return out


def test_bucketed_ddp_refuses_a_gradient_after_its_bucket_was_sent():
    torch.manual_seed(0)
    reference = nn.Linear(3, 1)
    reference(torch.arange(12.0).view(4, 3)).sum().backward()
    expected = reference.weight.grad / 2  # the mean over the 2 ranks of each one's 2 samples
    ranks = run_ranks(_twice_rank, 2, timeout=60)
    for out in ranks:
        assert "no_sync" in str(out[("DataParallelBucket", False)])  # refused, not wrong
        for key in (("DataParallelBucket", True), ("DataParallelNaive", True), ("DataParallelNaive", False)):
            assert torch.allclose(out[key], expected), key


def _fp16_rank(rank: int, world_size: int):
    out = {}
    for wrapper in (DataParallelNaive, DataParallelBucket):
        for dtype in (torch.float16, torch.bfloat16):
            model = nn.Linear(1, 1, bias=False)
            ddp = wrapper(model, grad_comm_dtype=dtype)
            ddp(torch.full((1, 1), 50000.0 if rank == 0 else 30000.0)).sum().backward()
            ddp.finish_gradient_synchronization()
            out[(wrapper.__name__, dtype)] = model.weight.grad.item()
    return out


def test_16_bit_gradient_communication_averages_without_overflow():
    for out in run_ranks(_fp16_rank, 2, timeout=60):
        for key, grad in out.items():  # one process: (50000 + 30000) / 2, each in fp16's range
            assert abs(grad - 40000.0) <= 40000.0 * 2 ** -8, (key, grad)  # one 16-bit rounding


class _Corners(nn.Module):
    """Defined c, b, a and run a (twice), b, c; ``rare`` only where a row starts positive."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.c, self.b, self.a = nn.Linear(4, 1), nn.Linear(4, 4), nn.Linear(4, 4)
        self.rare = nn.Linear(4, 4)
        self.empty = nn.Parameter(torch.zeros(0))
        self.frozen = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x):
        h = self.a(self.a(self.frozen(x))) + self.empty.sum()
        if (x[:, 0] > 0).any():
            h = h + self.rare(h) * (x[:, :1] > 0)
        return self.c(torch.tanh(self.b(h))).pow(2).mean()


def _micro_batch(i: int) -> torch.Tensor:
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 + i))
    x[:, 0] = -x[:, 0].abs()
    x[0, 0] = 1.0  # only rank 0's first row takes the rare branch
    return x


def _corners_rank(rank: int, world_size: int, micro: int):
    model = _Corners()
    reference = copy.deepcopy(model)
    for i in range(micro):
        (reference(_micro_batch(i)) / micro).backward()
    errors = {}
    for name, make in (("naive", DataParallelNaive), ("bucket 25 MB", DataParallelBucket),
                       ("bucket 1 B", lambda m: DataParallelBucket(m, bucket_cap_mb=1e-6))):
        model_copy = copy.deepcopy(model)
        ddp = make(model_copy)
        for i in range(micro):
            with ddp.no_sync() if i < micro - 1 else contextlib.nullcontext():
                (ddp(_micro_batch(i)[2 * rank: 2 * rank + 2]) / micro).backward()
        ddp.finish_gradient_synchronization()
        for (n, p), r in zip(model_copy.named_parameters(), reference.parameters()):
            if (p.grad is None) != (r.grad is None):
                errors[(name, n)] = "presence"
            elif p.grad is not None and not torch.allclose(p.grad, r.grad, atol=1e-6):
                errors[(name, n)] = (p.grad - r.grad).abs().max().item()
    return errors


def test_data_parallel_corners_equal_one_process():
    assert run_ranks(_corners_rank, 2, 3, timeout=60) == [{}, {}]


# --- wrapping a module again (a re-run notebook cell) ---------------------------------------------
# The first wrapper's gradient hooks used to stay on the parameters: with DataParallelBucket each
# backward all-reduced twice (6 all-reduces instead of 3 here, twice the bytes, half never waited
# for); with ZeRO-2 the old optimizer's hook freed the gradients before the new one packed them, so
# the step used none. FSDP, wrapped again, broadcast rank 0's shards into rank 1's shards of other
# sizes: gloo aborted the ranks.

def _rewrap_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def _rewrap_batch() -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(3))


def _rewrap_rank(rank: int, world_size: int):
    x = _rewrap_batch()[2 * rank: 2 * rank + 2]
    out = {}
    for times in (1, 2):  # wrapped once, and the same model wrapped twice
        model, comms = _rewrap_model(), Comms()
        for _ in range(times):  # 1e-5 MiB buckets: one per parameter, 3 by backward's order
            ddp = DataParallelBucket(model, comms=comms, bucket_cap_mb=1e-5)
        comms.reset()  # the step's collectives only, both wrappers' (they share comms)
        ddp(x).pow(2).mean().backward()
        ddp.finish_gradient_synchronization()
        out[("ddp", times)] = (dict(comms.calls), [p.grad.clone() for p in model.parameters()])
    for times in (1, 2):
        model, comms = _rewrap_model(), Comms()
        for _ in range(times):
            opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, shard_gradients=True,
                                   comms=comms, bucket_cap_mb=1e-5)
        comms.reset()
        model(x).pow(2).mean().backward()
        opt.step()
        out[("zero2", times)] = (dict(comms.calls), [p.detach().clone() for p in model.parameters()])
    return out


def test_wrapping_a_module_again_replaces_the_first_wrappers_hooks():
    reference = _rewrap_model()
    reference(_rewrap_batch()).pow(2).mean().backward()
    grads = [p.grad for p in reference.parameters()]
    stepped = [p.detach() - 0.1 * p.grad for p in reference.parameters()]  # one SGD step
    for out in run_ranks(_rewrap_rank, 2, timeout=60):
        assert out[("ddp", 2)][0] == out[("ddp", 1)][0] == {"all_reduce": 3}  # not 6
        assert out[("zero2", 2)][0] == out[("zero2", 1)][0] == {"reduce_scatter": 3, "all_gather": 3}
        for times in (1, 2):
            for kind, want in (("ddp", grads), ("zero2", stepped)):
                for got, w in zip(out[(kind, times)][1], want):
                    assert torch.allclose(got, w, atol=1e-6), (kind, times)


def _fsdp_rewrap_rank(rank: int, world_size: int):
    model = _rewrap_model()
    fsdp = FullyShardedDataParallel(model)
    try:
        FullyShardedDataParallel(model)  # a re-run cell
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)  # the first wrapper still works
    fsdp(_rewrap_batch()[2 * rank: 2 * rank + 2]).pow(2).mean().backward()
    fsdp.finish_gradient_synchronization()
    opt.step()
    with fsdp.summon_full_params():
        return refused, [p.detach().clone() for p in model.parameters()]


def test_fsdp_refuses_a_module_wrapped_already():
    reference = _rewrap_model()
    reference(_rewrap_batch()).pow(2).mean().backward()
    for refused, params in run_ranks(_fsdp_rewrap_rank, 2, timeout=60):
        assert "wrapped already" in refused
        for got, r in zip(params, reference.parameters()):
            assert torch.allclose(got, r.detach() - 0.1 * r.grad, atol=1e-6)
