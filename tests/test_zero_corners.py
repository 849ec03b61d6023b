"""Corners of the course's ZeRO-3 against one process, on 2 gloo ranks (probed beyond
tests/test_parallel_data.py's corners).

* ``requires_grad`` toggled between steps (freeze a layer for a while, then unfreeze it). Under
  ZeRO-3 the module's parameters between steps are the fp32 master shards (FSDP2's convention), so
  that is what a user freezes: the whole tensors that forward computes with must follow, or the
  frozen layer still gets gradients and is stepped. One process leaves it alone (no gradient, so
  AdamW skips it). Both kinds of parameter: sharded, and replicated with a separate master
  (``replicate=`` with a ``compute_dtype``).
"""

from __future__ import annotations

import pytest
import torch

from course_lib.launch.spawn import run_ranks
from course_lib.parallel.strategy import build_strategy
from course_lib.parallel.toy import ToyMLP, adamw, toy_batch

STEPS, B = 4, 4  # B rows per rank
FROZEN = [False, True, True, False]  # the toggled parameters, per step


def _toy() -> ToyMLP:
    torch.manual_seed(0)
    return ToyMLP(width=10, n_layers=3)


def _toggled(model) -> list[torch.nn.Parameter]:
    return [model.layers[1].weight, model.layers[1].bias]  # sharded; replicated when replicate= asks


def _toggle_worker(rank: int, world_size: int) -> dict:
    ref = _toy()
    ref_opt = adamw(ref)
    out = {}
    runs = {"zero3": {}, "zero3 replicated biases, float64 compute":
            {"replicate": lambda p: p.dim() < 2, "compute_dtype": torch.float64}}
    strategies = {label: build_strategy("zero3", _toy(), adamw, **kw) for label, kw in runs.items()}
    for step in range(STEPS):
        x, y = toy_batch(B * world_size, seed=100 + step)
        for p in _toggled(ref):
            p.requires_grad_(not FROZEN[step])
        ref_opt.zero_grad(set_to_none=True)
        ref(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        for strategy in strategies.values():
            for p in _toggled(strategy.module):  # the module's parameters: the masters
                p.requires_grad_(not FROZEN[step])
            xs, ys = x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]
            strategy.model(xs, ys)[1].backward()
            strategy.finish_grads()
            strategy.clip_grad_norm_(0.5)
            strategy.step()
            strategy.zero_grad()
    want = ref.state_dict()
    for label, strategy in strategies.items():
        got = strategy.state_dict()["model"]
        out[label] = max((got[k] - v).abs().max().item() for k, v in want.items())
    return out


@pytest.mark.timeout(60)
def test_zero3_follows_requires_grad_toggled_between_steps():
    for r in run_ranks(_toggle_worker, 2, timeout=30):
        assert r["zero3"] <= 1e-6, r
        assert r["zero3 replicated biases, float64 compute"] <= 1e-5, r
