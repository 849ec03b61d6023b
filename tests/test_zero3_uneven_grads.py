"""ZeRO-3 when a unit's parameter gets a gradient on some ranks only, on 2 gloo ranks.

:class:`BranchNet` is a stack of blocks (ZeRO-3 units) between a root embedding and a root head;
one block in the middle holds a branch (a sub-module) that a rank computes only when its own rows
ask for it (a data-dependent ``if``), so the branch's parameters get a gradient on those ranks
only, on no rank at all in some steps, or in one micro-batch of one rank under gradient
accumulation. Before the fix the ranks started that unit's reduce-scatter at different points of
backward (the one rank when the branch's last gradient arrived, the other in
``finish_gradient_synchronization``): the collectives paired up wrongly and the ranks hung until the
collective timeout. Each run is bounded (``run_ranks(timeout=...)``): a hang fails in seconds.

The references, as in tests/test_zero_corners.py and tests/test_parallel_zero_wrappers.py: one
process on the global batch (fp32: parameters equal to 1e-6 after 3 AdamW steps; bf16 compute:
within bf16 noise), and for bf16 also the same 2-rank ZeRO-3 run with the imbalance taken away
(every rank computes the branch in every step some rank takes it, multiplied by its 0/1 gate:
the same numbers bit for bit, since x + 0 * b is x and a zero gradient adds nothing).

The runs go through the trainer's ``Zero3`` strategy (clipping included) and record the order of
the units' reduce-scatters, which must be the same on both ranks. Also: a unit run twice in one
forward; every forward before the backwards (a pipeline's AFAB); the rule's bookkeeping (one
reduce-scatter per unit and backward for the toy and the GPT, with and without full activation
recomputation: the parameters' gradients are in ``.grad`` when a unit's post-backward point comes,
so none arrives late); gradients that do arrive late (a unit under reentrant
``torch.utils.checkpoint``, whose forward runs without gradients; one rank's gradient added late in
backward), reduced at finish on every rank, with and without a root unit to carry the flags; and
evaluation under ``no_grad``, which leaves nothing behind.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib.launch.spawn import run_ranks
from course_lib.parallel.toy import adamw, toy_batch

B, MAX_NORM, BRANCH_AT = 4, 0.5, 2  # rows per rank (per micro-batch under accumulation)
TIMEOUT = 20  # seconds per collective: a hang becomes a RanksTimeoutError


class Block(nn.Module):
    """h + gelu(lin(h)), plus ``branch(h) * gate`` where the rows' 0/1 ``gate`` asks for it."""

    def __init__(self, d: int, branch: bool):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.branch = nn.Linear(d, d) if branch else None

    def forward(self, h, gate=None, always: bool = False):
        out = h + F.gelu(self.lin(h))
        if self.branch is not None and (always or bool(gate.any())):  # data-dependent
            out = out + self.branch(h) * gate
        return out


class BranchNet(nn.Module):
    """Root embedding -> 4 blocks (units; block 2 holds the branch) -> root head. ``twice``: block 1
    runs twice in every forward (the same unit, two post-backward points per backward);
    ``reentrant``: block 2 runs under reentrant ``torch.utils.checkpoint`` (its forward, hooks and
    all, without gradients; rerun inside backward): no post-backward point is registered for it,
    and all of its gradients reach .grad late, in backward, unknown to the wrapper until then."""

    def __init__(self, d_in: int = 12, d: int = 10, n_classes: int = 5, n_blocks: int = 4,
                 twice: bool = False, reentrant: bool = False):
        super().__init__()
        self.embed = nn.Linear(d_in, d)  # in the root: the blocks' inputs require grad
        self.blocks = nn.ModuleList(Block(d, branch=i == BRANCH_AT) for i in range(n_blocks))
        self.head = nn.Linear(d, n_classes)
        self.twice, self.reentrant = twice, reentrant
        self.always = False  # the balanced run: compute the branch even where this rank's gate is 0

    def forward(self, x, gate, targets=None):
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            for _ in range(2 if self.twice and i == 1 else 1):
                if self.reentrant and i == BRANCH_AT and torch.is_grad_enabled():
                    h = checkpoint(block, h, gate, self.always, use_reentrant=True)
                else:
                    h = block(h, gate=gate, always=self.always)
        logits = self.head(h)
        return logits, None if targets is None else F.cross_entropy(logits.float(), targets)


def branch_net(**kwargs) -> BranchNet:
    torch.manual_seed(0)
    return BranchNet(**kwargs)


def branch_params(model: nn.Module) -> list[nn.Parameter]:
    return list(model.blocks[BRANCH_AT].branch.parameters())


def batch(step: int, world_size: int, accum: int, takers) -> tuple:
    """The global batch of ``step``: x, its 0/1 gate (the rows of each (rank, micro-batch) in
    ``takers`` take the branch), targets; rank r's rows are [r accum B, (r+1) accum B)."""
    n = world_size * accum * B
    x, y = toy_batch(n, seed=100 + step)
    gate = torch.zeros(n, 1)
    for rank, micro in takers:
        start = (rank * accum + micro) * B
        gate[start: start + B] = 1.0
    return x, gate, y


def reference(schedule, world_size: int, accum: int, **net) -> tuple[dict, list]:
    """One process on the global batch with the trainer's AdamW and clipping: final state, and per
    step whether the branch had a gradient."""
    model = branch_net(**net)
    opt = adamw(model)
    had_grad = []
    for step, takers in enumerate(schedule):
        x, gate, y = batch(step, world_size, accum, takers)
        opt.zero_grad(set_to_none=True)
        model(x, gate, y)[1].backward()
        had_grad.append([p.grad is not None for p in branch_params(model)])
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return model.state_dict(), had_grad


def train_zero3(strategy, model, schedule, rank: int, world_size: int, accum: int,
                balanced: bool = False, afab: bool = False) -> list:
    """The same steps on this rank's rows, ``accum`` micro-batches each (``afab``: every forward
    before the backwards, as a pipeline schedule runs them); per step whether the branch's
    masters had a gradient after ``finish_grads``."""
    had_grad = []
    for step, takers in enumerate(schedule):
        x, gate, y = batch(step, world_size, accum, takers)
        model.always = balanced and bool(takers)  # the balanced run: every rank computes the branch
        mine = slice(rank * accum * B, (rank + 1) * accum * B)
        x, gate, y = x[mine], gate[mine], y[mine]
        losses = []
        for micro in range(accum):
            rows = slice(micro * B, (micro + 1) * B)
            losses.append(strategy.model(x[rows], gate[rows], y[rows])[1] / accum)
            if not afab:
                losses.pop().backward()
        for loss in losses:
            loss.backward()
        strategy.finish_grads()
        had_grad.append([p.grad is not None for p in branch_params(model)])  # the module shows the masters
        strategy.clip_grad_norm_(MAX_NORM)
        strategy.step()
        strategy.zero_grad()
    return had_grad


def uneven_worker(rank: int, world_size: int, schedule, accum: int, dtype, options: dict) -> dict:
    from course_lib.parallel.strategy import build_strategy
    from course_lib.parallel.zero.zero3 import FullyShardedDataParallel

    launched = []  # the units reduce-scattered, in order (the same list on every rank)
    launch = FullyShardedDataParallel._launch
    FullyShardedDataParallel._launch = lambda self, unit, *a: launched.append(self.units.index(unit)) or launch(
        self, unit, *a)

    net = {k: v for k, v in options.items() if k in ("twice", "reentrant")}
    want, want_grad = reference(schedule, world_size, accum, twice=net.get("twice", False))
    out = {"reference had grad": want_grad}
    kwargs = {} if dtype is None else {"compute_dtype": dtype}
    runs = [("uneven", False)] + ([("balanced", True)] if dtype is not None else [])
    for label, balanced in runs:
        model = branch_net(**net)
        if options.get("no_root"):  # the root's parameters replicated: no root unit
            root = {id(p) for m in (model.embed, model.head) for p in m.parameters()}
            kwargs["replicate"] = lambda p: id(p) in root
        strategy = build_strategy("zero3", model, adamw, **kwargs)
        launched.clear()
        had_grad = train_zero3(strategy, model, schedule, rank, world_size, accum, balanced,
                               afab=options.get("afab", False))
        got = strategy.state_dict()["model"]
        out[label] = {"had grad": had_grad, "state": got, "launched": list(launched),
                      "diff": max((got[k] - v).abs().max().item() for k, v in want.items())}
    out["moved"] = max((want[k] - v).abs().max().item() for k, v in branch_net().state_dict().items()
                       if ".branch." in k)
    return out


def run_schedule(schedule, accum: int = 1, dtype=None, **options) -> list[dict]:
    return run_ranks(uneven_worker, 2, schedule, accum, dtype, options, timeout=TIMEOUT)


def check_fp32(results, tol: float = 1e-6) -> None:
    assert results[0]["uneven"]["launched"] == results[1]["uneven"]["launched"]  # the same collectives
    for r in results:
        assert r["moved"] > 1e-3, r["moved"]  # the branch trained in the reference
        got = r["uneven"]
        assert got["had grad"] == r["reference had grad"], (got["had grad"], r["reference had grad"])
        assert got["diff"] <= tol, got["diff"]


# the (rank, micro-batch) pairs that take the branch, per step
RANK0_ONLY, RANK1_ONLY, NOBODY = {(0, 0)}, {(1, 0)}, set()


@pytest.mark.timeout(90)
def test_a_branch_taken_on_one_rank_only_trains_as_one_process():
    # a: rank 0 only, then rank 1 only, then rank 0 only
    check_fp32(run_schedule([RANK0_ONLY, RANK1_ONLY, RANK0_ONLY]))


@pytest.mark.timeout(90)
def test_b_a_branch_no_rank_takes_gets_no_gradient_and_no_update():
    # b: step 1 takes the branch nowhere: no .grad on any rank (AdamW skips it, no decay), as in one process
    results = run_schedule([RANK0_ONLY, NOBODY, RANK1_ONLY])
    check_fp32(results)
    for r in results:
        assert r["uneven"]["had grad"] == [[True, True], [False, False], [True, True]], r["uneven"]["had grad"]


@pytest.mark.timeout(90)
def test_c_gradient_accumulation_with_the_branch_in_one_micro_batch_of_one_rank():
    # c: 2 micro-batches per step; the branch in one micro-batch of one rank, then in one
    # micro-batch of each, then in the other rank's other one, then nowhere
    check_fp32(run_schedule([{(0, 1)}, {(1, 0), (0, 1)}, {(1, 1)}, NOBODY], accum=2))


@pytest.mark.timeout(90)
def test_d_bf16_compute_with_a_branch_on_one_rank():
    results = run_schedule([RANK0_ONLY, NOBODY, RANK1_ONLY], dtype=torch.bfloat16)
    for r in results:
        uneven, balanced = r["uneven"], r["balanced"]
        assert uneven["had grad"] == r["reference had grad"], uneven["had grad"]
        # the imbalance changes nothing: the balanced run's numbers, bit for bit
        assert max((uneven["state"][k] - v).abs().max().item() for k, v in balanced["state"].items()) == 0
        # and one process in fp32 up to bf16 compute (AdamW moves a weight by <= lr = 3e-3 a step)
        assert uneven["diff"] <= 2e-2, uneven["diff"]


@pytest.mark.timeout(90)
def test_a_unit_run_twice_per_forward_with_the_branch_on_one_rank():
    # block 1 runs twice: its reduce-scatter waits for its second post-backward point
    check_fp32(run_schedule([RANK0_ONLY, NOBODY, RANK1_ONLY], twice=True))


@pytest.mark.timeout(90)
def test_all_forwards_before_the_backwards_with_the_branch_on_one_rank():
    # a pipeline's AFAB order: two forwards, then their two backwards; each backward reduces its own
    check_fp32(run_schedule([{(0, 0)}, {(1, 1)}, NOBODY], accum=2, afab=True))


@pytest.mark.timeout(90)
def test_reentrant_checkpointing_of_the_branch_block_reduces_it_at_finish():
    # the block under reentrant checkpointing: all of its gradients late, reduced at finish (the
    # root's reduce-scatter at the end of backward carried the flags): block 2 last in every step
    results = run_schedule([RANK0_ONLY, NOBODY, RANK1_ONLY], reentrant=True)
    check_fp32(results)
    launched = results[0]["uneven"]["launched"]
    # units: 0 the root, 1 + i block i. Blocks 3, 1, 0 at their points, the root at the end of
    # backward, block 2 at finish
    assert launched == [4, 2, 1, 0, 3] * 3, launched


@pytest.mark.timeout(90)
def test_without_a_root_unit_the_late_flags_travel_alone():
    # the root's parameters replicated: no unit ends a backward, so finish agrees on the late
    # gradients (the reentrant block's) with one small all-reduce of its own
    results = run_schedule([RANK0_ONLY, NOBODY, RANK1_ONLY], reentrant=True, no_root=True)
    check_fp32(results)
    launched = results[0]["uneven"]["launched"]
    assert launched == [3, 1, 0, 2] * 3, launched  # units: block 0 .. 3; block 2 at finish


# --- the rule's bookkeeping ---------------------------------------------------------------------


def count_worker(rank: int, world_size: int) -> dict:
    """Reduce-scatters per step for the toy, the GPT, the GPT under full recomputation (the blocks
    rerun inside backward, their hooks too) and the GPT with 2 micro-batches: one per unit and
    backward, none late; the parameters equal one process."""
    from course_lib.gpt.model import GPT, GPTConfig
    from course_lib.parallel.strategy import build_strategy
    from course_lib.parallel.toy import ToyMLP

    cfg = GPTConfig(block_size=8, vocab_size=29, n_layer=3, n_head=2, n_embd=16, bias=False)
    out = {}
    for label in ("toy", "gpt", "gpt full recompute", "gpt accumulation"):
        torch.manual_seed(0)
        model = ToyMLP() if label == "toy" else GPT(cfg).set_recompute("full" if "recompute" in label else "none")
        ref = ToyMLP() if label == "toy" else GPT(cfg)
        ref.load_state_dict(model.state_dict())
        strategy = build_strategy("zero3", model, adamw)
        ref_opt = adamw(ref)
        accum = 2 if "accumulation" in label else 1
        calls = []
        for step in range(2):
            if label == "toy":
                x, y = toy_batch(2 * accum * B, seed=step)
            else:
                g = torch.Generator().manual_seed(step)
                idx = torch.randint(0, cfg.vocab_size, (2 * accum * B, cfg.block_size + 1), generator=g)
                x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
            ref_opt.zero_grad(set_to_none=True)
            ref(x, y)[1].backward()
            ref_opt.step()
            strategy.comms.reset()
            for micro in range(accum):
                rows = slice((rank * accum + micro) * B, (rank * accum + micro + 1) * B)
                (strategy.model(x[rows], y[rows])[1] / accum).backward()
            strategy.finish_grads()
            calls.append(strategy.comms.calls["reduce_scatter"])
            strategy.step()
            strategy.zero_grad()
        got = strategy.state_dict()["model"]
        # every unit once per backward: at its post-backward point, or at the backward's end (the
        # root, the toy's first layer fed the data)
        out[label] = {"calls": calls, "want": accum * len(strategy.model.units),
                      "diff": max((got[k] - v).abs().max().item() for k, v in ref.state_dict().items())}
    return out


@pytest.mark.timeout(120)
def test_one_reduce_scatter_per_unit_and_backward_none_late():
    # Every unit's gradients are in .grad when its post-backward point comes (the autograd engine
    # runs a parameter's AccumulateGrad as soon as it is ready, ahead of every other node): a late
    # gradient would cost its unit a second reduce-scatter at finish_gradient_synchronization.
    for r in run_ranks(count_worker, 2, timeout=TIMEOUT):
        for label, got in r.items():
            assert got["calls"] == [got["want"]] * 2, (label, got)
            assert got["diff"] <= 1e-6, (label, got)


def late_worker(rank: int, world_size: int) -> dict:
    """(1) a gradient put into one unit's .grad on rank 0 only, late in backward (by a hook on the
    root embedding's output: after every unit's post-backward point), as a gradient that reaches
    its unit after its reduce-scatter: the ranks agree to reduce it at finish, and it counts as
    one process would count it; (2) evaluation under no_grad after a step leaves no unit whole,
    nothing pending, no bookkeeping open."""
    from course_lib.parallel.comms import Comms
    from course_lib.parallel.zero.sharding import gather_full
    from course_lib.parallel.zero.zero3 import FullyShardedDataParallel

    x, gate, y = batch(0, world_size, 1, RANK0_ONLY)
    ref = branch_net()
    ref(x, gate, y)[1].backward()
    extra = torch.full_like(ref.blocks[1].lin.weight, 0.25)  # rank 0's late gradient
    wanted = {n: p.grad.clone() for n, p in ref.named_parameters()}
    wanted["blocks.1.lin.weight"] += extra / world_size  # averaged over the ranks, as every gradient
    ours = FullyShardedDataParallel(branch_net())
    whole = next(p for p, n in ours.names.items() if n == "blocks.1.lin.weight")  # not the shown shard
    seen = []

    def late(grad):
        seen.append(whole.grad is None)  # block 1's gradient went out with its reduce-scatter
        if rank == 0:
            whole.grad = extra.clone()

    ours.module.embed.register_forward_hook(lambda m, a, out: out.register_hook(late) and None
                                            if out.requires_grad else None)
    mine = slice(rank * B, (rank + 1) * B)
    ours(x[mine], gate[mine], y[mine])[1].backward()
    ours.finish_gradient_synchronization()
    full = {n: gather_full(Comms(None), *ours.layout_of.get(p, (None, 0)), ours.masters[p].grad)
            for p, n in ours.names.items()}
    out = {"late diff": max((full[n] - g).abs().max().item() for n, g in wanted.items()), "seen": seen}
    with torch.no_grad():
        ours(x[mine], gate[mine])
    out["whole after eval"] = [u.state for u in ours.units if u.state != "free"]
    out["pending after eval"] = len(ours.pending)
    out["open after eval"] = sum(bool(getattr(u, "due", None)) or bool(getattr(u, "unhooked", None))
                                 for u in ours.units) + len(getattr(ours, "reached", ()))
    return out


@pytest.mark.timeout(90)
def test_a_late_gradient_on_one_rank_is_reduced_at_finish_on_every_rank():
    for r in run_ranks(late_worker, 2, timeout=TIMEOUT):
        assert r["seen"] == [True] and r["late diff"] <= 1e-6, r
        assert r["whole after eval"] == [] and r["pending after eval"] == 0 and r["open after eval"] == 0, r
