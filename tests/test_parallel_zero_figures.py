"""Measured memory and communication of DP and ZeRO stages 1-3 against the ZeRO paper's formulas.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(arXiv:1910.02054). Memory, Sec. 5 / Figure 1, per device with Psi parameters and N ranks, for
mixed-precision Adam (2-byte weights and gradients, K = 12): 16 Psi, 4 Psi + 12 Psi / N,
2 Psi + 14 Psi / N, 16 Psi / N. On CPU in fp32 the same model with fp32 byte sizes applies
(4-byte weights and gradients, K = 8: Adam's two moments, the weights are their own master copy):
course_lib.analysis.memory.model_state_bytes(dtype="fp32"). Communication, Sec. 7.2: per rank and step,
data parallelism and ZeRO-1/2 move 2 Psi, ZeRO-3 3 Psi (course_lib.analysis.comm_cost.zero_comm_volume).

Each rank measures the live tensors of our implementations (course_lib.parallel.footprint) after
backward, after the gradient communication and after the step, and the bytes that went through
its collectives during one step. Differences: zero-padding of shards (each parameter is padded to
a multiple of N) and Adam's per-parameter step counters (4 bytes each).
"""

from __future__ import annotations

import pytest
import torch

from course_lib.analysis.comm_cost import zero_comm_volume
from course_lib.analysis.memory import model_state_bytes
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.footprint import measure_model_states, peak
from course_lib.parallel.strategy import build_strategy
from course_lib.parallel.toy import ToyMLP, adamw, toy_batch

STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
REL = 0.03  # "within a few percent"


def toy() -> ToyMLP:
    torch.manual_seed(0)
    return ToyMLP(d_in=16, width=64, n_layers=4)  # the root's own head is small: 2.4% of Psi


def one_step(strategy, x, y):
    """A training step with model-state snapshots at the three points where they peak."""
    loss = strategy.model(x, y)[1]
    loss.backward()
    after_backward = measure_model_states(strategy)
    strategy.finish_grads()
    after_comm = measure_model_states(strategy)
    strategy.clip_grad_norm_(1.0)
    strategy.step()
    after_step = measure_model_states(strategy)
    strategy.zero_grad()
    return peak(after_backward, after_comm, after_step)


def figures_worker(rank: int, world_size: int) -> dict:
    out = {}
    for name in STAGES:
        strategy = build_strategy(name, toy(), adamw)
        one_step(strategy, *toy_batch(8, seed=rank, d_in=16))  # creates the optimizer states
        strategy.comms.reset()
        states = one_step(strategy, *toy_batch(8, seed=10 + rank, d_in=16))
        out[name] = {"states": states, "volume": dict(strategy.comms.volume),
                     "sent": strategy.comms.sent_bytes,
                     "psi": sum(p.numel() for p in toy().parameters()),  # the module shows shards (ZeRO-3)
                     "psi_root": sum(p.numel() for p in toy().head.parameters())}
    # a parameter used by two ZeRO-3 units cannot be freed by one of them: a clear error
    shared = toy()
    shared.layers[2].weight = shared.layers[1].weight
    try:
        build_strategy("zero3", shared, adamw)
        out["shared_error"] = None
    except ValueError as e:
        out["shared_error"] = str(e)
    return out


def close(measured: float, expected: float) -> bool:
    return abs(measured - expected) <= REL * expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_memory_and_communication_match_the_paper(world_size):
    results = run_ranks(figures_worker, world_size)
    for rank, res in enumerate(results):
        for name, stage in STAGES.items():
            r = res[name]
            psi, where = r["psi"], f"rank {rank} {name} (stage {stage}), N={world_size}"
            # memory: each category and the total
            model = model_state_bytes(psi, world_size, stage, dtype="fp32")
            for what in ("params", "grads", "optimizer", "total"):
                got, want = getattr(r["states"], what), getattr(model, what)
                assert close(got, want), f"{where}: {what} {got} B, paper {want:.0f} B"
            # communication: the paper's volumes (2 Psi, 2 Psi, 2 Psi, 3 Psi) and ring bytes sent
            paper = zero_comm_volume(psi, stage, world_size, bytes_per_elem=4, exact=False)
            ring = zero_comm_volume(psi, stage, world_size, bytes_per_elem=4, exact=True)
            elems = 2 if stage < 3 else 3
            assert sum(paper.values()) == elems * psi * 4
            volume = sum(r["volume"].values())
            assert close(volume, sum(paper.values())), f"{where}: {volume} B moved, paper {paper}"
            assert close(r["sent"], sum(ring.values())), f"{where}: sent {r['sent']}, ring {ring}"
            if stage == 0:
                assert set(r["volume"]) == {"all_reduce"}
            else:  # one all-reduce of the squared gradient norm (4 bytes) for clipping
                assert r["volume"]["all_reduce"] == 2 * 4
                assert close(r["volume"]["reduce_scatter"], psi * 4)
                gathers = 1 if stage < 3 else 2
                assert close(r["volume"]["all_gather"], gathers * psi * 4)
            if stage == 3:  # the root (here the head) is gathered once, not twice (as FSDP)
                units_and_root = 2 * psi - r["psi_root"]
                assert close(r["volume"]["all_gather"], units_and_root * 4)
        assert res["shared_error"] and "used by 2 ZeRO-3 units" in res["shared_error"]


def test_memory_shrinks_with_stage_as_in_the_paper():
    """The paper's Figure 1 example, mixed precision (K = 12), through ``model_state_bytes`` with its
    default dtype: Psi = 7.5e9, N = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB."""
    gb = [model_state_bytes(7.5e9, 64, s).total / 1e9 for s in range(4)]
    assert [round(g, 1) for g in gb] == [120.0, 31.4, 16.6, 1.9]
