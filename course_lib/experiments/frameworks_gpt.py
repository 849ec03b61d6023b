"""The course GPT on Shakespeare, trained the course's way and Lightning Fabric's way, each against
one process step by step, with bytes per rank and bytes communicated beside the models (notebook 11).

    from course_lib.launch.spawn import run_ranks
    from course_lib.experiments.frameworks_gpt import RUNS, compare_runs, rows
    results = run_ranks(compare_runs, 2, data_dir)      # results[0]: rank 0's dict
    rows(results[0])                                            # one table row per run

Runs (the same global batch every step, each rank its half):

    course ddp          course_lib.parallel.data.ddp.DDP (our buckets and hooks)
    torch ddp           torch.nn.parallel.DistributedDataParallel (the course's torch_ddp strategy)
    fabric ddp          Fabric's DDPStrategy, i.e. DistributedDataParallel set up by Lightning
    course zero3        course_lib.parallel.zero.zero3 (our ZeRO-3 / FSDP)
    fabric fsdp2        Fabric's ModelParallelStrategy with FSDP2's fully_shard on each block

and the reference: one process, the whole global batch per step (the course's ``single``).
Every run starts from the same weights (one seed on every rank: FSDP2 does not broadcast) and uses
AdamW without clipping, so each loss curve must equal the reference up to float rounding.

Memory is the model states one rank holds after a step (:func:`course_lib.parallel.footprint.measure_model_states`,
live tensors; the gradients are freed by then) beside :func:`course_lib.analysis.memory.model_state_bytes`
(fp32: 4 bytes of parameter and 8 of Adam per parameter, sharded by ZeRO stage); communication is each rank's volume in one step (ZeRO paper
accounting) beside :func:`course_lib.analysis.comm_cost.zero_comm_volume` (2 Psi for DP, 3 Psi for ZeRO-3).
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from course_lib.analysis.comm_cost import zero_comm_volume
from course_lib.analysis.memory import model_state_bytes
from course_lib.experiments.frameworks_fabric import (
    CollectiveCounter,
    ddp_counting_hook,
    fabric_setup,
    fabric_step,
    inner_optimizer,
    make_fabric,
    wrapped,
)
from course_lib.gpt.data import TrainBatches, load_tokens
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.parallel.footprint import measure_model_states
from course_lib.parallel.step import train_step
from course_lib.parallel.strategy import build_strategy

# run label -> (whose, strategy name, ZeRO stage of its memory and communication model)
RUNS = {"course ddp": ("course", "ddp", 0), "torch ddp": ("course", "torch_ddp", 0),
        "fabric ddp": ("fabric", "ddp", 0), "course zero3": ("course", "zero3", 3),
        "fabric fsdp2": ("fabric", "fsdp2", 3)}
SMALL = {"block_size": 32, "vocab_size": 65, "n_layer": 2, "n_head": 2, "n_embd": 32, "bias": False,
         "dropout": 0.0}
DATASET = "shakespeare_char"


def adamw_with_lr(lr: float):
    return lambda m: torch.optim.AdamW(m.parameters(), lr=lr, foreach=True)


def batches(data_dir, cfg: GPTConfig, steps: int, batch: int, dp_rank: int, dp_world: int, seed: int):
    """``steps`` (x, y) of shape (batch, T): this rank's rows of each global batch of dp_world x batch
    Shakespeare windows (one rank with dp_world=1 and the whole batch draws the same windows)."""
    data = TrainBatches(load_tokens(data_dir, DATASET, "train"), batch, cfg.block_size, 1, dp_rank, dp_world, seed)
    return [tuple(t[0] for t in data.next()) for _ in range(steps)]


def one_process(data_dir, gpt: dict, steps: int, batch: int, world: int, lr: float, seed: int) -> list[float]:
    """The reference: one process, the whole global batch (world x batch rows) per step."""
    cfg = GPTConfig(**gpt)
    torch.manual_seed(seed)
    single = build_strategy("single", GPT(cfg), adamw_with_lr(lr))
    return [train_step(single, x[None], y[None]).loss.item()
            for x, y in batches(data_dir, cfg, steps, batch * world, 0, 1, seed)]


def _global_mean(loss: torch.Tensor, world: int) -> float:
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / world


def _course_run(name, cfg, data, lr, world):
    strategy = build_strategy(name, GPT(cfg), adamw_with_lr(lr))
    counter = CollectiveCounter()
    if name == "torch_ddp":  # PyTorch's reducer all-reduces in C++: count its buckets with a hook
        strategy.model.register_comm_hook(counter, ddp_counting_hook)
    losses, seconds = [], []
    for i, (x, y) in enumerate(data):
        if i == len(data) - 1:  # count the last step only (the first includes one-off set-up)
            counter.__init__()
            if getattr(strategy, "comms", None) is not None:
                strategy.comms.reset()
        t0 = time.perf_counter()
        loss = train_step(strategy, x[None], y[None]).loss
        seconds.append(time.perf_counter() - t0)
        losses.append(_global_mean(loss, world))
    comms = getattr(strategy, "comms", None)
    volume = comms.volume_bytes if comms is not None and name != "torch_ddp" else counter.volume_bytes
    return losses, seconds, measure_model_states(strategy), volume


def _fabric_run(name, cfg, data, lr, world):
    counter = CollectiveCounter()
    fabric = make_fabric(name)
    model, opt = fabric_setup(fabric, GPT(cfg), adamw_with_lr(lr))
    if name == "ddp":  # the DistributedDataParallel Fabric built: count its buckets with a hook
        wrapped(model).register_comm_hook(counter, ddp_counting_hook)
    losses, seconds = [], []
    for i, (x, y) in enumerate(data):
        if i == len(data) - 1:
            counter.__init__()
        t0 = time.perf_counter()
        # FSDP2's collectives go through torch.distributed's Python functions; DDP's are counted
        # by the hook alone (its default all-reduce would otherwise be counted twice)
        with counter if name == "fsdp2" else contextlib.nullcontext():
            loss = fabric_step(fabric, model, opt, x, y)
        seconds.append(time.perf_counter() - t0)
        losses.append(_global_mean(loss, world))
    held = measure_model_states(SimpleNamespace(module=model, optimizer=inner_optimizer(opt)))
    volume = counter.volume_bytes
    return losses, seconds, held, volume


def compare_runs(rank: int, world: int, data_dir, runs=tuple(RUNS), gpt: dict | None = None,
                 steps: int = 4, batch: int = 4, lr: float = 1e-3, seed: int = 0) -> dict:
    """On every rank (``run_ranks(compare_runs, 2, data_dir)``): each run of ``runs`` and the
    one-process reference. Returns {"reference": losses, "num_params": Psi, run: {losses, step_ms,
    held (bytes of model states on this rank), held_model, comm (bytes this rank moved in the last
    step), comm_model}}."""
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise ValueError(f"unknown runs {unknown}; choose from {list(RUNS)}")
    gpt = {**SMALL, **(gpt or {})}
    cfg = GPTConfig(**gpt)
    data = batches(data_dir, cfg, steps, batch, rank, world, seed)
    out = {"reference": one_process(data_dir, gpt, steps, batch, world, lr, seed)}
    for label in runs:
        whose, name, stage = RUNS[label]
        torch.manual_seed(seed)  # the reference's weights on every rank
        run = _course_run if whose == "course" else _fabric_run
        losses, seconds, held, volume = run(name, cfg, data, lr, world)
        psi = sum(p.numel() for p in GPT(cfg).parameters())
        out["num_params"] = psi
        out[label] = {"losses": losses, "step_ms": 1e3 * sum(seconds[1:] or seconds) / len(seconds[1:] or seconds),
                      "held": held.total, "held_model": _after_step(model_state_bytes(psi, world, stage, dtype="fp32")),
                      "comm": volume,
                      "comm_model": sum(zero_comm_volume(psi, stage, world, bytes_per_elem=4, exact=False).values())}
    return out


def _after_step(states) -> float:
    """What the model says one rank holds after a step: parameters and Adam's states (the
    gradients were freed by ``zero_grad(set_to_none=True)``, in every run alike)."""
    return states.params + states.optimizer


def rows(result: dict) -> list[dict]:
    """One row per run: largest |loss - one process| over the steps, memory and bytes against the models."""
    ref = result["reference"]
    out = []
    for label in RUNS:
        if label not in result:
            continue
        r = result[label]
        out.append({"run": label, "max |loss - one process|": max(abs(a - b) for a, b in zip(r["losses"], ref)),
                    "final loss": r["losses"][-1], "model states KB / rank": r["held"] / 1e3,
                    "model KB": r["held_model"] / 1e3, "comm KB / step / rank": r["comm"] / 1e3,
                    "model comm KB": r["comm_model"] / 1e3, "step ms": r["step_ms"]})
    return out
