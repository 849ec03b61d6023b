"""The trainer with every strategy: same data and seed give the same losses, and checkpoints of
sharded strategies resume exactly (also under another strategy: every strategy saves the full
state in one format).

The trainer (course_lib.trainer.loop.train) runs in-process on 2 gloo ranks per strategy, on a tiny
Shakespeare model for 6 iterations with 2 micro-batches of gradient accumulation and clipping.
The single-process reference uses micro-batches twice as large: the same global batch.
"""

from __future__ import annotations

import csv
import os

import pytest
import torch.distributed as dist

from course_lib.gpt.data import prepare
from course_lib.launch.spawn import run_ranks
from course_lib.registry import STRATEGIES, STRATEGY_NAMES
from course_lib.trainer.config import make_config

ITERS = 6
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 4,
        "gradient_accumulation_steps": 2, "max_iters": ITERS, "lr_decay_iters": ITERS,
        "warmup_iters": 2, "learning_rate": 3e-3, "eval_interval": 3, "eval_iters": 2,
        "log_interval": 1, "dropout": 0.0, "dtype": "float32", "device": "cpu", "threads": 1,
        "compile": False}
DISTRIBUTED = [s for s in STRATEGY_NAMES if s != "single"]


def trainer_worker(rank: int, world_size: int, configs: list[dict], stores: list[str]) -> list[dict]:
    from course_lib.trainer.config import TrainConfig
    from course_lib.trainer.loop import train

    if world_size > 1:  # what torchrun would set; the process group exists already
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
    summaries = []
    for cfg, store in zip(configs, stores):
        # train() ends the group it ran in; the ranks carry RANK and WORLD_SIZE (as under torchrun),
        # so even one rank trains in a group, made anew for each run
        if not dist.is_initialized():
            # a new file per group: a TCP port picked free at the start could by now be one of
            # gloo's own listening sockets, and the ranks would wait on it forever
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        summaries.append(train(TrainConfig.from_dict(cfg), progress=False))
    return summaries


def run(configs: list, world_size: int) -> None:
    stores = [os.path.join(os.path.dirname(c.out_dir), f".store-{os.path.basename(c.out_dir)}-{i}")
              for i, c in enumerate(configs)]
    # a hang (a rank stuck while the other moved on) fails in 2 minutes with the ranks named
    run_ranks(trainer_worker, world_size, [c.to_dict() for c in configs], stores, timeout=120)


def losses(out_dir) -> dict[int, tuple]:
    with open(os.path.join(out_dir, "metrics.csv")) as f:
        return {int(r["iter"]): (r["train_loss"], r["val_loss"], r["eval_train_loss"])
                for r in csv.DictReader(f)}


def numbers(row: tuple) -> list[float]:
    return [float(v) for v in row if v not in ("", None)]  # train, val, eval-train losses


@pytest.mark.timeout(300)
def test_every_strategy_gives_the_same_losses_and_resumes(tmp_path):
    assert set(STRATEGY_NAMES) == set(STRATEGIES)  # the trainer offers every strategy we have
    prepare("shakespeare_char", quiet=True)
    base = make_config("shakespeare_char_cpu", TINY)
    run([base.replace(out_dir=str(tmp_path / "single"), strategy="single", batch_size=8)], 1)
    dist_runs = [base.replace(out_dir=str(tmp_path / s), strategy=s, nproc=2) for s in DISTRIBUTED]
    # checkpoints: stop at iteration 3 and resume to the end, with the same or another strategy;
    # every resumed run must continue exactly like the uninterrupted one
    half = {"max_iters": 3, "nproc": 2}
    resumes = [("ddp", "ddp"), ("zero3", "zero3"), ("fsdp_full", "zero1"), ("zero2", "fsdp_grad_op")]
    first = [base.replace(out_dir=str(tmp_path / f"{a}-{b}"), strategy=a, **half) for a, b in resumes]
    second = [base.replace(out_dir=str(tmp_path / f"{a}-{b}"), strategy=b, nproc=2,
                           init_from="resume") for a, b in resumes]
    run(dist_runs + first + second, 2)

    # the single process sees the same training batches and the same eval rows (each of its
    # batches is the two ranks' batches together): every loss it logs is compared
    single, ref = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert sorted(single) == sorted(ref) == list(range(ITERS + 1))
    for name in DISTRIBUTED + [f"{a}-{b}" for a, b in resumes]:
        got = losses(tmp_path / name)
        assert sorted(got) == sorted(ref), name
        for it in ref:
            assert numbers(got[it]) == pytest.approx(numbers(ref[it]), rel=2e-6, abs=0), (name, it)
            assert numbers(got[it]) == pytest.approx(numbers(single[it]), rel=2e-6, abs=0), (name, it)
