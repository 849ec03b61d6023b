"""Data parallel and ZeRO strategies equal a single-process reference on real gloo processes.

Each spawned rank trains the same model two ways: a single-process reference on the global
batch, and the strategy under test on its 1/N slice with two micro-batches of gradient
accumulation, global-norm clipping and AdamW. After 10 steps the mean loss, the clipped global
gradient norm, the full (gathered) parameters and optimizer states must match to ~1e-6, and a
fresh strategy loaded from ``state_dict()`` must continue exactly like the reference (resume).
Ranks other than 0 start from a different initialisation: the strategy must broadcast rank 0's.

The corners (issue 13), on 2 and 3 ranks for each of our strategies: :class:`CornerNet` has a
frozen layer, a branch no rank ever uses, a branch only some ranks use on some steps (decided by
the data), tied input/output embeddings, and gradient accumulation; once more under bf16 autocast
(fp32 master weights, 16-bit compute). The parameter that never gets a gradient and the frozen one
must end exactly where they started, with no optimizer state, as in one process.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib.gpt.model import GPT, GPTConfig
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.strategy import build_strategy
from course_lib.parallel.toy import ToyMLP, adamw, toy_batch
from course_lib.registry import STRATEGIES

STEPS, ACCUM, MICRO_B, MAX_NORM = 10, 2, 2, 0.5
TOL = 1e-6
# bias=False: the key bias of attention has an exactly zero gradient (softmax ignores a constant
# added to every score of a query), so its "gradient" is rounding noise that AdamW normalises into
# lr-sized steps; any change of summation order (all-reduce vs one process) then shows up at 1e-6.
GPT_CFG = GPTConfig(block_size=8, vocab_size=29, n_layer=2, n_head=2, n_embd=16, bias=False)


class CornerNet(nn.Module):
    """Every corner at once: frozen, never used, sometimes used, tied (x: (B, T) token ids)."""

    def __init__(self, vocab: int = 7, d: int = 12, unused: bool = True):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.frozen = nn.Linear(d, d).requires_grad_(False)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(2))  # ZeRO-3 units
        if unused:  # PyTorch's DDP stops on these (no find_unused_parameters: parallel/strategy.py)
            self.never = nn.Linear(d, d)   # no gradient on any rank, ever
            self.rare = nn.Linear(d, d)    # a gradient only where a sequence starts with token 0
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, x, targets=None):
        h = self.frozen(self.wte(x))  # (B, T, d)
        gate = (x[:, :1] == 0).unsqueeze(-1)  # (B, 1, 1)
        if hasattr(self, "rare") and gate.any():  # a data-dependent branch: some ranks take it, some steps none
            h = h + self.rare(h) * gate
        for layer in self.layers:
            h = h + torch.nn.functional.gelu(layer(h))
        logits = self.lm_head(self.ln_f(h))
        loss = None if targets is None else torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten())
        return logits, loss


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind.startswith("corners"):
        return CornerNet(unused=not kind.startswith("corners-used"))
    return ToyMLP() if kind == "toy" else GPT(GPT_CFG)


def autocast(kind: str):
    """The bf16 corner: 16-bit compute under autocast, fp32 parameters and optimizer."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if kind.endswith("bf16") else contextlib.nullcontext()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return adamw(model, lr=3e-3)


def make_batch(kind: str, step: int, n: int):
    if kind == "toy":
        return toy_batch(n, seed=1000 + step)
    g = torch.Generator().manual_seed(1000 + step)
    vocab = 7 if kind.startswith("corners") else GPT_CFG.vocab_size
    idx = torch.randint(0, vocab, (n, GPT_CFG.block_size + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def reference_step(model, opt, x, y, kind="gpt"):
    opt.zero_grad(set_to_none=True)
    with autocast(kind):
        loss = model(x, y)[1]
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    return loss.item(), norm.item()


def strategy_step(strategy, x, y, rank, world_size, kind="gpt"):
    """This rank's slice of the global batch, in ACCUM micro-batches; returns global mean loss."""
    xs = x[rank * ACCUM * MICRO_B:(rank + 1) * ACCUM * MICRO_B]
    ys = y[rank * ACCUM * MICRO_B:(rank + 1) * ACCUM * MICRO_B]
    local = 0.0
    for micro in range(ACCUM):
        sync = micro == ACCUM - 1
        with contextlib.nullcontext() if sync else strategy.no_sync():
            sl = slice(micro * MICRO_B, (micro + 1) * MICRO_B)
            with autocast(kind):
                loss = strategy.model(xs[sl], ys[sl])[1] / ACCUM
            loss.backward()
            local += loss.item()
    strategy.finish_grads()
    norm = strategy.clip_grad_norm_(MAX_NORM)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    strategy.step()
    strategy.zero_grad()
    total = torch.tensor([local])
    dist.all_reduce(total)
    return total.item() / world_size, float(norm)


def max_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two nested state dicts of tensors and numbers."""
    worst = 0.0
    if isinstance(a, dict):
        assert set(a) == set(b), (sorted(map(str, a)), sorted(map(str, b)))
        for k, v in a.items():
            worst = max(worst, max_diff(v, b[k]))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            worst = max(worst, max_diff(u, v))
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape, (a.shape, b.shape)
        worst = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    elif isinstance(a, (int, float)):
        worst = abs(a - b)
    else:
        assert a == b, (a, b)
    return worst


def train_and_compare(name: str, kind: str, rank: int, world_size: int) -> tuple[dict, dict]:
    """Differences from the reference, and the strategy's final full state."""
    # rank 0's initialisation must win: the others start elsewhere
    strategy = build_strategy(name, make_model(kind, seed=rank), make_optimizer)
    ref = make_model(kind)
    ref_opt = make_optimizer(ref)
    loss_diff = norm_diff = 0.0
    for step in range(STEPS):
        x, y = make_batch(kind, step, world_size * ACCUM * MICRO_B)
        ref_loss, ref_norm = reference_step(ref, ref_opt, x, y, kind)
        loss, norm = strategy_step(strategy, x, y, rank, world_size, kind)
        loss_diff = max(loss_diff, abs(loss - ref_loss))
        norm_diff = max(norm_diff, abs(norm - ref_norm))
    state = strategy.state_dict()
    out = {"loss": loss_diff, "grad_norm": norm_diff,
           "params": max_diff(state["model"], ref.state_dict()),
           "optimizer": max_diff(state["optimizer"], ref_opt.state_dict())}
    # resume: a fresh strategy from the checkpoint continues exactly like the reference
    resumed = build_strategy(name, make_model(kind, seed=7), make_optimizer)
    resumed.load_state_dict(copy.deepcopy(state))  # loading may alias the given tensors
    x, y = make_batch(kind, STEPS, world_size * ACCUM * MICRO_B)
    reference_step(ref, ref_opt, x, y, kind)
    strategy_step(resumed, x, y, rank, world_size, kind)
    out["resume"] = max_diff(resumed.state_dict()["model"], ref.state_dict())
    return out, state


def equivalence_worker(rank: int, world_size: int, names: list[str], pairs: list) -> dict:
    results, states = {}, {}
    for name in names:
        for kind in ("toy", "gpt"):
            results[name, kind], states[name, kind] = train_and_compare(name, kind, rank, world_size)
    for ours, theirs in pairs:  # ours against PyTorch's, directly, on the same model and data
        for kind in ("toy", "gpt"):
            results[f"{ours} vs {theirs}", kind] = {
                "params": max_diff(states[ours, kind]["model"], states[theirs, kind]["model"]),
                "optimizer": max_diff(states[ours, kind]["optimizer"],
                                      states[theirs, kind]["optimizer"])}
    return results


OURS = ["ddp_naive", "ddp", "zero1", "zero2", "zero3"]
TORCH = ["torch_ddp", "torch_zero1", "fsdp_grad_op", "fsdp_full"]
# ZeroRedundancyOptimizer is ZeRO-1; FSDP2 without/with resharding after forward is ZeRO-2/-3.
PAIRS = [("ddp", "torch_ddp"), ("zero1", "torch_zero1"), ("zero2", "fsdp_grad_op"),
         ("zero3", "fsdp_full")]


def check_equivalence(results: list[dict]) -> None:
    bad = [f"rank {r} {name}/{kind}: {what} differs by {d:.2e}"
           for r, res in enumerate(results) for (name, kind), diffs in res.items()
           for what, d in diffs.items() if not d <= TOL]
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(240)
def test_ours_and_pytorchs_equal_single_process_2_ranks():
    assert set(OURS + TORCH) <= set(STRATEGIES)
    results = run_ranks(equivalence_worker, 2, OURS + TORCH, PAIRS)
    assert len(results[0]) == 2 * len(OURS + TORCH) + 2 * len(PAIRS)
    check_equivalence(results)


def torch_ddp_buckets(rank: int, world_size: int) -> tuple:
    ddp = build_strategy("torch_ddp", ToyMLP(d_in=16, width=64, n_layers=2), adamw).model
    config = getattr(ddp, "_bucket_config", None)  # newer torch; older: the flag below
    first = config.first_bucket_bytes_cap if config is not None else (
        torch.distributed._DEFAULT_FIRST_BUCKET_BYTES if ddp.bucket_bytes_cap_default else ddp.bucket_bytes_cap)
    return ddp.bucket_bytes_cap, first


@pytest.mark.timeout(120)
def test_torch_ddp_keeps_pytorchs_default_buckets_with_the_small_first_one():
    """torch_ddp leaves bucket_cap_mb unset, as PyTorch's users do: 25 MiB buckets and a 1 MiB first
    one, as our ddp's first_bucket_cap_mb=1.0 (passing 25 explicitly would turn the first one off)."""
    assert run_ranks(torch_ddp_buckets, 2)[0] == (25 * 2**20, 2**20)


@pytest.mark.timeout(240)
def test_ours_equal_single_process_4_ranks():
    check_equivalence(run_ranks(equivalence_worker, 4, OURS, []))


def corners_worker(rank: int, world_size: int, names: list[str], kinds=("corners", "corners-bf16")) -> dict:
    results = {}
    for name in names:
        for kind in kinds:
            diffs, state = train_and_compare(name, kind, rank, world_size)
            start = make_model(kind).state_dict()
            untouched = [k for k in start if "never" in k or "frozen" in k]
            diffs["exact: never-used and frozen moved"] = max_diff(
                {k: state["model"][k] for k in untouched}, {k: start[k] for k in untouched})
            diffs["exact: parameters with optimizer state"] = abs(len(state["optimizer"]["state"])
                                                                  - CORNER_STATES[kind.startswith("corners-used")])
            results[name, kind] = diffs
    return results


# AdamW state exists for the trainable parameters that got a gradient at least once: wte (tied
# with lm_head), rare, 2 layers, ln_f (weight and bias each): not `never`, not the frozen layer.
CORNER_STATES = {False: 1 + 2 + 2 * 2 + 2, True: 1 + 2 * 2 + 2}  # True: without never and rare
# fp32: summation order only (the loss of 2-3 micro-batch slices against one batch). bf16 autocast
# rounds every matmul to 8 significant bits (2**-8 = 0.4 %), differently for batches of other
# sizes, and AdamW carries that over 10 steps: measured up to 1.4e-2 on 3 ranks.
CORNER_TOL = {"corners": 2e-6, "corners-bf16": 5e-2, "corners-used": 2e-6, "corners-used-bf16": 5e-2}


def corner_failures(results: list) -> list[str]:
    return [f"rank {r} {name}/{kind}: {what} differs by {d:.2e}"
            for r, res in enumerate(results) for (name, kind), diffs in res.items()
            for what, d in diffs.items()
            if not d <= (0.0 if what.startswith("exact") else CORNER_TOL[kind])]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_corners_equal_single_process(world_size):
    bad = corner_failures(run_ranks(corners_worker, world_size, OURS))
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(300)
def test_pytorchs_strategies_in_the_corners_they_take():
    """PyTorch's wrappers in the corners of a model whose every trainable parameter is used
    (frozen, tied, accumulation, bf16): DDP without find_unused_parameters refuses unused ones,
    and FSDP2 aborts a rank on a branch that only some ranks run (parallel/zero/torch_sharded.py)."""
    bad = corner_failures(run_ranks(corners_worker, 2, TORCH, ("corners-used", "corners-used-bf16")))
    assert not bad, "\n".join(bad)
